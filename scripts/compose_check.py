"""compose_smoke.sh's checks, run in a container of the millstream image on the compose network
(`compose.sh run --rm --no-deps -T router python3 - < scripts/compose_check.py`): reads the run's
summary on the runs volume, asks the router and engines for their weight versions, Phoenix
(service traces) for the widest group trace and Prometheus which jobs it scrapes. Prints one
JSON object.

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
}


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.load(response)


def spans(**query: str | list[str]) -> list[dict]:
    return get(f"{PHOENIX}?{urllib.parse.urlencode(query, doseq=True)}")["data"]


def widest_group_trace() -> tuple[str, list[str], int]:
    """(trace id, its services, its span count) of the widest admitted group's trace among those
    that reached an engine: a coalesced /generate batch is a child of its first group only."""
    engine_spans = spans(attribute="millstream.stage:engine", limit="300")
    trace_ids = list(dict.fromkeys(s["context"]["trace_id"] for s in engine_spans))[:60]
    best: tuple[str, list[str], int] = ("", [], 0)
    for i in range(0, len(trace_ids), 20):
        by_trace: dict[str, list[dict]] = {}
        for span in spans(trace_id=trace_ids[i : i + 20], limit="1000"):
            by_trace.setdefault(span["context"]["trace_id"], []).append(span)
        for trace_id, group in by_trace.items():
            stages = {s["attributes"].get("millstream.stage") for s in group}
            if "admit" not in stages:  # an eval round's trace
                continue
            services = sorted({STAGE_SERVICE[st] for st in stages if st in STAGE_SERVICE})
            if (len(services), len(group)) > (len(best[1]), best[2]):
                best = (trace_id, services, len(group))
    return best


def main() -> None:
    run = "/runs/" + os.environ.get("MILLSTREAM_RUN_ID", "arith")
    with open(f"{run}/summary.json") as f:
        summary = json.load(f)
    c = summary["counts"]
    terminal = sum(c[k] for k in ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end"))  # fmt: skip
    curve = [acc for _, _, acc in summary["eval_curve"]]
    engines = get("http://router:30000/list_workers")["urls"]
    versions = [get(u + "/get_weight_version")["weight_version"] for u in engines]
    trace_id, services, n_spans = widest_group_trace()
    targets = get(PROMETHEUS)["data"]["activeTargets"]
    jobs_up = sorted({t["labels"]["job"] for t in targets if t["health"] == "up"})
    print(json.dumps({
        "admitted": c["admitted"], "terminal": terminal,
        "eval_first": next(iter(curve[0].values())), "eval_last": list(curve[-1].values())[-1],
        "engines": len(engines), "versions": versions,
        "trace_id": trace_id, "trace_services": services, "trace_spans": n_spans,
        "prometheus_jobs_up": jobs_up,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
