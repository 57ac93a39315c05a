"""The table of `make gpu-check` (bench/gpu_check.py): a row per check, each with what was
measured, the goal and a verdict, from the stages' results.

Verdicts: PASS; BELOW, a speed goal of bench_gpu.py not met (a failure only with --strict);
FAIL, a test failed, a stage crashed or ran out of time, a row was not measured, or an arith
run did not reach 85% (on a GPU also: did not sync over CUDA IPC); skip, a GPU test where
torch sees no GPU (--device cpu); not reached, a GPU-marked test the stage's time ran out
before (or while) it ran; info, the environment and the peaks of memory.
"""

from __future__ import annotations

import json
from pathlib import Path

Row = tuple[str, str, str, str]  # check, measured, goal, verdict
DOCS_START, DOCS_END = "<!-- gpu-check:start -->", "<!-- gpu-check:end -->"
VERDICTS = ("PASS", "BELOW", "FAIL", "not reached")


def read_events(path: Path) -> list[dict]:
    """gpu_pytest.py's lines; a last line cut by a kill is left out."""
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _short(node_id: str) -> str:
    """tests/unit/test_a.py::test_x[p] -> test_a::test_x[p]."""
    path, _, rest = node_id.partition("::")
    return f"{Path(path).stem}::{rest}"


def _outcome(reports: list[dict]) -> tuple[str, str]:
    """(verdict, measured) of one test's phase reports."""
    seconds = sum(r["seconds"] for r in reports)
    for r in reports:
        if r["outcome"] == "failed":
            where = "" if r["when"] == "call" else f" (in {r['when']})"
            return "FAIL", f"failed{where} in {seconds:.1f} s: {r['message']}"
    for r in reports:
        if r["outcome"] == "skipped":
            return "skip", f"skipped: {r['message'][:120]}"
    if any(r["when"] == "call" for r in reports):
        return "PASS", f"passed in {seconds:.1f} s"
    return "", ""  # no call yet: it was running when the stage ended


def test_rows(
    jsonl: Path, stage: dict | None, expected: list[str], name: str = "tests"
) -> list[Row]:
    """A row per GPU-marked test of the stage `name`: what gpu_pytest.py reported, and every
    test it did not report (from its collected list, else `expected`, the stage's node ids)
    as not reached, or as FAIL when pytest died while it ran."""
    label = "GPU-marked tests" if name == "tests" else "GPU-marked contract tests"
    if stage is None:
        return []
    if name == "contract" and stage["rc"] == 4 and "sglang is not importable" in str(stage):
        return [(label, "not run: sglang is not importable here (scripts/bootstrap.sh puts the "
                 "contract tier's in .venv/sglang)", "pass", "skip")]  # fmt: skip
    events = read_events(jsonl)
    collected = next((e["ids"] for e in events if e["event"] == "collected"), None)
    if collected is None and not stage["timed_out"] and stage["rc"] is not None:
        return [(label, f"no report (exit {stage['rc']}): {' | '.join(stage['tail'])}", "pass",
                 "FAIL")]  # fmt: skip
    if collected == []:
        return [(label, "none collected", "every test in docs/testing.md", "FAIL")]
    reports: dict[str, list[dict]] = {}
    for e in events:
        if e["event"] == "report":
            reports.setdefault(e["id"], []).append(e)
    started = {e["id"] for e in events if e["event"] == "start"}
    rows: list[Row] = []
    for node_id in collected if collected is not None else expected:
        verdict, measured = _outcome(reports.get(node_id, []))
        if not verdict and node_id in started and not stage["timed_out"]:
            verdict, measured = "FAIL", f"pytest died while it ran (exit {stage['rc']})"
        elif not verdict:
            verdict = "not reached"
            measured = ("cut off by the stage's time limit while it ran" if node_id in started
                        else "not started: the stage's time ran out first")  # fmt: skip
        rows.append((f"test {_short(node_id)}", measured, "pass", verdict))
    clean = stage["rc"] in (0, 5) or stage["timed_out"]
    if not clean and not any(r[3] == "FAIL" for r in rows):
        rows.append((label, f"exit {stage['rc']}: {' | '.join(stage['tail'])}", "exit 0",
                     "FAIL"))  # fmt: skip
    return rows


def bench_rows(result: dict | None, stage: dict | None, strict: bool) -> list[Row]:
    if stage is None:
        return []
    if result is None:
        return [("bench_gpu.py", f"no result: {' | '.join(stage['tail'])}", "rows", "FAIL")]
    goals = {g["row"]: g for g in result.get("goals", [])}
    rows: list[Row] = []
    for r in result["rows"]:
        if r["value"] is None:
            rows.append((f"{r['section']}: {r['name']}", r["note"] or "not measured", "measured",
                         "FAIL"))  # fmt: skip
            continue
        ratio = f"; {r['ratio']:.3g}x {r['base']}" if r.get("ratio") is not None else ""
        detail = "; ".join(x for x in (r.get("detail"), r.get("note")) if x)
        measured = f"{r['value']:.4g} {r['unit']}{ratio}" + (f"; {detail}" if detail else "")
        g = goals.get(r["name"])
        verdict = "PASS" if g is None or g["met"] else ("FAIL" if strict else "BELOW")
        rows.append((f"{r['section']}: {r['name']}", measured, g["target"] if g else "", verdict))
    if not result.get("done", True):
        last = result["rows"][-1]["name"] if result["rows"] else "the start"
        rows.append(("bench_gpu.py", f"stopped after {len(result['rows'])} rows (the last: "
                     f"{last}): the rest not measured", "every section", "FAIL"))  # fmt: skip
    return rows


def arith_rows(
    result: dict | None, stage: dict | None, device: str, small: bool = False
) -> list[Row]:
    """A row per arith run. With --small (the plumbing on a CPU) a run of a few rollouts is
    judged on running to its end, not on 85%: the e2e tests hold the CPU's learning."""
    if stage is None:
        return []
    if result is None or (not result["rows"] and not result.get("done", True)):
        return [("arith --colocate --bf16", f"no result: {' | '.join(stage['tail'])}", "85%",
                 "FAIL")]  # fmt: skip
    rows: list[Row] = []
    for r in result["rows"]:
        e = r.get("extra") or {}
        ran = small and e.get("iterations") is not None
        if r["value"] is None and not ran:
            rows.append((r["name"], r["note"] or "not measured", "85%", "FAIL"))
            continue
        routes = "; ".join(e.get("routes", [])) or "no transport line"
        to_85 = f"85% at {r['value']:.1f} s" if r["value"] is not None else "85% not reached"
        measured = (f"{to_85} (best {e.get('best_eval')}); {e.get('completions_per_s', 0):.0f} "
                    f"completions/s; {e.get('iterations')} iterations; pool "
                    f"{e.get('max_total_tokens') or 'uncapped'}; transport: {routes}; graph "
                    f"captures {e.get('graph_captures')}; "
                    f"tracebacks {e.get('tracebacks')}")  # fmt: skip
        if small:
            goal = f"{e.get('rollouts')} rollouts to the end (--small: 85% not judged)"
            ok = e.get("iterations") == e.get("rollouts")
        else:
            goal, ok = "85%; CUDA IPC sync", device != "cuda" or "CUDA IPC" in routes
        ok = ok and not e.get("tracebacks")
        name = f"run: {r['name']}" + (" --bf16" if device == "cuda" else "")
        rows.append((name, measured, goal, "PASS" if ok else "FAIL"))
    return rows


def memory_rows(stages: dict[str, dict], device: str) -> list[Row]:
    where = "device" if device == "cuda" else "host"
    return [
        (f"peak {where} memory in use: {name}",
         "n/a" if s["peak_mib"] is None else f"{s['peak_mib'] / 1024:.2f} GiB", "", "info")
        for name, s in stages.items()
    ]  # fmt: skip


def stage_rows(stages: dict[str, dict]) -> list[Row]:
    """A FAIL per stage out of time or (but the test stages, whose tests have rows) failed; an
    info row per stage that left processes running (gpu_stage.py ended them)."""
    rows: list[Row] = []
    for name, s in stages.items():
        if s["timed_out"] or (name not in ("tests", "contract") and s["rc"] != 0):
            rows.append((f"stage {name}", f"exit {s['rc']} after {s['seconds']:.0f} s"
                         f"{' (out of time)' if s['timed_out'] else ''}: {' | '.join(s['tail'])}",
                         "exit 0 in time", "FAIL"))  # fmt: skip
        if s.get("left_running") and not s["timed_out"]:
            rows.append((f"stage {name}", f"{s['left_running']} processes outlived it (ended)",
                         "none", "info"))  # fmt: skip
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| check | measured | goal | verdict |", "| --- | --- | --- | --- |"]
    lines += [f"| {c} | {m.replace('|', '/')} | {g} | {v} |" for c, m, g, v in rows]
    return "\n".join(lines)


def docs_section(report: dict) -> str:
    env = report["environment"]
    where = (f"{env.get('card')} ({env.get('memory_gib', '?')} GiB, compute capability "
             f"{env.get('capability', '?')}, driver {env.get('driver', '?')}); Python "
             f"{env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), "
             f"transformers {env.get('transformers')}")  # fmt: skip
    counts = {v: sum(1 for r in report["rows"] if r[3] == v) for v in VERDICTS}
    partial = (
        ""
        if report.get("complete", True)
        else " (PARTIAL: written after a stage; the run did not end)"
    )
    return (
        f"Measured by `make gpu-check` at commit {report['commit']} on {where}, "
        f"{report['date']}, {report['seconds']:.0f} s in all{partial}: {counts['PASS']} PASS, "
        f"{counts['BELOW']} BELOW a goal, {counts['FAIL']} FAIL, {counts['not reached']} not "
        f"reached.\n\n{table(report['rows'])}\n"
    )


def publish(report: dict, docs: Path) -> None:
    text = docs.read_text()
    if DOCS_START not in text or DOCS_END not in text:
        raise SystemExit(f"{docs}: no {DOCS_START} ... {DOCS_END} markers to write between")
    head, rest = text.split(DOCS_START, 1)
    _, tail = rest.split(DOCS_END, 1)
    docs.write_text(f"{head}{DOCS_START}\n{docs_section(report)}{DOCS_END}{tail}")
