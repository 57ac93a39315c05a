"""compose_smoke.sh's checks, run in a container of the millstream image on the compose network
(`compose.sh run --rm --no-deps -T router python3 - < scripts/compose_check.py`): reads the run's
summary on the runs volume, asks the router and engines for their weight versions, counts the
trained groups whose trace is whole in the run's span files (`millstream trace`'s reading,
`trace_cli.not_whole`), asks Phoenix (service traces) for the trace of a group whose files hold every stage and Prometheus
which jobs it scrapes. Prints one JSON object.

Phoenix keeps span attributes but not the resource's service.name, so a span's service is the
one its `millstream.stage` belongs to (docs/observability.md: one trace per group)."""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request

PHOENIX = "http://traces:6006/v1/projects/default/spans"
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


def group_trace_in_viewer(run: str) -> tuple[str, list[str], int]:
    """(trace id, its services, its span count) in Phoenix of a trained group's trace whose
    spans in the run's files (copies for viewers included) hold every stage: what a user who
    opens one group's trace in the viewer sees."""
    import glob

    stages_of: dict[str, set[str]] = {}
    for path in glob.glob(f"{run}/traces/*.jsonl") + glob.glob(f"{run}/../services/traces/*.jsonl"):
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                try:
                    span = json.loads(line)
                    stage = span["attributes"].get("millstream.stage")
                except (ValueError, KeyError):
                    continue
                if stage:
                    stages_of.setdefault(span["trace_id"], set()).add(stage)
    wanted = {"admit", "rollout", "router", "engine", "reward", "train_step", "weight_sync"}
    candidates = [t for t, stages in stages_of.items() if wanted <= stages][:5]
    best: tuple[str, list[str], int] = ("", [], 0)
    for trace_id in candidates:
        found = spans(trace_id=trace_id, limit="1000")
        stages = {s["attributes"].get("millstream.stage") for s in found}
        services = sorted({STAGE_SERVICE[st] for st in stages if st in STAGE_SERVICE})
        if (len(services), len(found)) > (len(best[1]), best[2]):
            best = (trace_id, services, len(found))
    return best


def whole_traces(run: str) -> tuple[int, int, dict[str, int]]:
    """(trained groups whose trace holds every stage, trained groups, the stages the others
    lack -> how many lack each), from the run's span files as `millstream trace` reads them."""
    from pathlib import Path

    from millstream.common import trace_cli

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
    trace_id, services, n_spans = group_trace_in_viewer(run)
    whole, trained, lacking = whole_traces(run)
    targets = get(PROMETHEUS)["data"]["activeTargets"]
    jobs_up = sorted({t["labels"]["job"] for t in targets if t["health"] == "up"})
    print(json.dumps({
        "admitted": c["admitted"], "terminal": terminal,
        "eval_first": next(iter(curve[0].values())), "eval_last": list(curve[-1].values())[-1],
        "engines": len(engines), "versions": versions,
        "trace_id": trace_id, "trace_services": services, "trace_spans": n_spans,
        "whole_traces": whole, "trained_groups": trained, "stages_lacking": lacking,
        "prometheus_jobs_up": jobs_up,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
