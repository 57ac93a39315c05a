"""compose_smoke.sh's checks, run in a container of the millstream image on the compose network
(`compose.sh run --rm --no-deps -T router python3 - < scripts/compose_check.py`): reads the run's
summary on the runs volume, asks the router and engines for their weight versions, counts the
trained groups whose trace is whole in the run's span files (`millstream trace`'s reading,
`trace_cli.not_whole`) and in Phoenix (service traces: every span the files hold for the
group's trace, by span id, read page by page), picks the group trace Phoenix holds whole that
spans the most stages, and asks Prometheus which jobs it scrapes. Prints one JSON object.

Phoenix keeps span attributes but not the resource's service.name, so a span's service is the
one its `millstream.stage` belongs to (docs/observability.md: one trace per group)."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
import urllib.request

PHOENIX = "http://traces:6006/v1/projects/default/spans"
GRAPHQL = "http://traces:6006/graphql"
PROMETHEUS = "http://prometheus:9090/api/v1/targets?state=active"
STAGE_SERVICE = {
    "admit": "trainer",
    "prompts_wait": "rollout",
    "rollout": "rollout",
    "router": "router",
    "engine": "engine",
    "generated_wait": "reward",
    "reward": "reward",
    "reward_task": "reward-celery",
    "buffer_wait": "trainer",
    "train_step": "trainer",
    "weight_sync": "trainer",
}


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def spans(**query: str | list[str]) -> list[dict]:
    return get(f"{PHOENIX}?{urllib.parse.urlencode(query, doseq=True)}")["data"]


def file_spans(run: str) -> dict[str, list[dict]]:
    """trace id -> the spans the run's files hold for it (every service's files)."""
    import glob

    traces: dict[str, list[dict]] = {}
    for path in glob.glob(f"{run}/traces/*.jsonl") + glob.glob(f"{run}/../services/traces/*.jsonl"):
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                try:
                    span = json.loads(line)
                except ValueError:
                    continue
                traces.setdefault(span["trace_id"], []).append(span)
    return traces


def viewer_span_ids() -> dict[str, set[str]]:
    """trace id -> the span ids Phoenix holds, every span of the project, page by page."""
    held: dict[str, set[str]] = {}
    cursor = ""
    while True:
        page = get(
            f"{PHOENIX}?{urllib.parse.urlencode({'limit': 1000, 'cursor': cursor} if cursor else {'limit': 1000})}"
        )
        for span in page["data"]:
            held.setdefault(span["context"]["trace_id"], set()).add(span["context"]["span_id"])
        cursor = page.get("next_cursor") or ""
        if not cursor:
            return held


def viewer_span_count() -> int:
    """How many spans Phoenix holds (its GraphQL recordCount)."""
    query = json.dumps({"query": "{ projects { edges { node { name recordCount } } } }"}).encode()
    request = urllib.request.Request(GRAPHQL, query, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        edges = json.load(response)["data"]["projects"]["edges"]
    return sum(e["node"]["recordCount"] for e in edges if e["node"]["name"] == "default")


def groups_in_viewer(run: str) -> dict:
    """How many trained groups' traces Phoenix holds whole, and the one to look at: of those,
    the trace with the most services (then spans). Phoenix writes spans into SQLite at some
    100 a second on the 2-core machine, slower than a run makes them: it is given until it
    holds every span, up to PHOENIX_WAIT_S (default 600) seconds."""
    traces = file_spans(run)

    def stages(spans: list[dict]) -> set[str]:
        return {s["attributes"].get("millstream.stage") for s in spans}

    # A group's trace starts at its admission; an iteration's own trace has a train step too.
    trained = {t: spans for t, spans in traces.items() if {"admit", "train_step"} <= stages(spans)}
    # Counting is cheap (GraphQL), reading every span is not: count until Phoenix holds as many
    # spans as the files (or its count stops growing for a minute), then read once.
    total = sum(len(spans) for spans in traces.values())
    started = last_growth = time.monotonic()
    deadline = started + float(os.environ.get("PHOENIX_WAIT_S", "600"))
    count = -1
    while time.monotonic() < deadline and time.monotonic() - last_growth < 60:
        now_count = viewer_span_count()
        if now_count >= total:
            break
        if now_count > count:
            count, last_growth = now_count, time.monotonic()
        print(f"Phoenix holds {now_count} of {total} spans {time.monotonic() - started:.0f} s after the run; waiting", file=sys.stderr, flush=True)  # fmt: skip
        time.sleep(10)
    waited = time.monotonic() - started
    held = viewer_span_ids()
    whole = [
        t for t, spans in trained.items() if {s["span_id"] for s in spans} <= held.get(t, set())
    ]

    def services(trace_id: str) -> list[str]:
        stages = {s["attributes"].get("millstream.stage") for s in trained[trace_id]}
        return sorted({STAGE_SERVICE[st] for st in stages if st in STAGE_SERVICE})

    best = max(whole, key=lambda t: (len(services(t)), len(trained[t])), default="")
    roots = [s["name"] for s in trained.get(best, []) if not s["parent_span_id"]]
    return {
        "viewer_whole": len(whole), "viewer_groups": len(trained),
        "viewer_missing": len(trained) - sum(1 for t in trained if t in held),
        "viewer_wait_s": round(waited),
        "trace_id": best, "trace_services": services(best) if best else [],
        "trace_spans": len(trained.get(best, [])), "trace_root": roots[0] if roots else "",
    }  # fmt: skip


def whole_traces(run: str) -> tuple[int, int, dict[str, int]]:
    """(trained groups whose trace holds every stage, trained groups, the stages the others
    lack -> how many lack each), from the run's span files as `millstream trace` reads them."""
    from pathlib import Path

    from millstream.tools import trace_cli

    spans, _ = trace_cli.read_spans(Path(run))
    index = trace_cli.Run.index(spans)
    missing = trace_cli.not_whole(index)
    lacking: dict[str, int] = {}
    for stages in missing.values():
        for stage in stages:
            lacking[stage] = lacking.get(stage, 0) + 1
    return len(index.trained_in) - len(missing), len(index.trained_in), lacking


def main() -> None:
    run = "/runs/" + os.environ.get("MILLSTREAM_RUN_ID", "arith")
    with open(f"{run}/summary.json") as f:
        summary = json.load(f)
    c = summary["counts"]
    terminal = sum(c[k] for k in ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end"))  # fmt: skip
    curve = [acc for _, _, acc in summary["eval_curve"]]
    engines = get("http://router:30000/list_workers")["urls"]
    versions = [get(u + "/get_weight_version")["weight_version"] for u in engines]
    viewer = groups_in_viewer(run)
    whole, trained, lacking = whole_traces(run)
    targets = get(PROMETHEUS)["data"]["activeTargets"]
    jobs_up = sorted({t["labels"]["job"] for t in targets if t["health"] == "up"})
    print(json.dumps({
        "admitted": c["admitted"], "terminal": terminal,
        "eval_first": next(iter(curve[0].values())), "eval_last": list(curve[-1].values())[-1],
        "engines": len(engines), "versions": versions,
        **viewer,
        "whole_traces": whole, "trained_groups": trained, "stages_lacking": lacking,
        "prometheus_jobs_up": jobs_up,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
