"""The tiny arith-style job the e2e tests run through a real `millstream train`: its prompts
and the flags every such run shares, so that a test states only what it changes; and the
arith example's flags (`arith_flags`) for the checks that run before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

ARITH = Path(__file__).resolve().parents[2] / "examples" / "arith"


def write_prompts(path: Path, count: int = 40) -> Path:
    """`count` prompts "i+i=" labelled "2i" (JSONL, keys prompt and label)."""
    rows = ({"prompt": f"{i}+{i}=", "label": str(2 * i)} for i in range(count))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def job_flags(
    model: Path,
    prompts: Path,
    run_dir: Path,
    *extra: str,
    run_id: str | None = None,
    response_len: int = 6,
    rm_type: str | None = "exact",
) -> list[str]:
    """Two prompts a step, two samples each, `response_len` tokens at most, quiet logs; the
    run id is the run dir's name unless given; `extra` comes last (a later flag wins)."""
    flags = [
        "--hf-checkpoint", str(model), "--prompt-data", str(prompts),
        "--input-key", "prompt", "--label-key", "label",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", str(response_len),
        "--run-dir", str(run_dir), "--run-id", run_id or run_dir.name, "--log-level", "warning",
    ]  # fmt: skip
    if rm_type is not None:
        flags += ["--rm-type", rm_type]
    return [*flags, *extra]


def arith_flags(*extra: str) -> list[str]:
    """The arith example's flags that preflight cares about: a valid run of one rollout (no
    run dir: for the checks that run before anything starts); `extra` comes last."""
    return [
        "--hf-checkpoint", str(ARITH / "model"), "--prompt-data", str(ARITH / "data" / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact", "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", *extra,
    ]  # fmt: skip
