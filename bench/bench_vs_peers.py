"""Side by side on one task: millstream (sync and async) against an in-process GRPO loop with
plain HF + torch and TRL's GRPOTrainer, one after another on this machine, every one timed by
the wall clock over the same window, on the same cores and the same device.

    .venv/bin/python bench/bench_vs_peers.py [--configs small,medium] [--steps 100 | --minutes 5]
        [--peers ref,trl,sync,async] [--seeds 0,1,2] [--rounds 2] [--cores N] [--device cpu]
        [--lr 3e-5] [--eval-every 20] [--out runs/bench_vs_peers.json]
    .venv/bin/python bench/bench_vs_peers.py --report runs/bench_vs_peers.json

The task (bench/peers_task.py, built once per config and seed and cached under
runs/bench_peers/, about a minute for small and five for medium): two-digit addition
("37+45=" -> "82"), exact-match reward, a small Llama (`small` ~0.79M parameters, `medium`
~6.3M) SFT-warm-started to greedy ~30-50% on 200 held-out problems. Every peer runs the same
GRPO: 16 prompts x 8 samples per step at temperature 1 (full vocabulary), at most 6 new
tokens, advantage (r - mean) / (std + eps) per group, token-mean policy-gradient loss over
the batch, no KL, one Adam step per rollout (so the PPO ratio is 1; lr --lr, constant, betas
0.9/0.999, no weight decay, grad-norm clip 1.0), and a greedy eval on the 200 held-out
problems at step 0 and every --eval-every steps.

    ref     the reference loop below (~100 lines): HF generate, reward, one update; in a child
            process
    trl     trl.GRPOTrainer (loss_type dapo = token mean, beta 0, scale_rewards group; its std
            eps is 1e-4) with a callback that marks the steps and runs the same greedy eval, in
            a child process like ref; skipped when trl is not importable
            (.venv/bin/pip install -e '.[peers]')
    sync    `millstream train`: every service (redis, engine, router, rollout and reward
            workers) started by the command
    async   `millstream train-async --max-staleness 1 --pause-mode in_place`

The window. Every peer is timed by the wall clock over the same stretch of its run: from the
start of the greedy eval before step 1 to the end of the last step's update (millstream's: its
weight sync), the evals in between INCLUDED, the eval after the last step left out. So every
window holds the same work: the steps and 1 + (steps - 1) // --eval-every evals. Evals are in
because millstream's admission keeps generating during them (during the step-0 eval too: the
first batch), which a window without them would hand it for free. The marks:

    ref, trl      time.time() in the child: before the step-0 eval, and after each optimizer
                  step (TRL: its on_step_end)
    sync, async   the trainer's spans, RUN_DIR/traces/trainer-*.jsonl: the start of the
                  `trainer.eval` span of iteration 0; a step ends where the `trainer.weight_sync`
                  span in its `trainer.iteration` span ends (one whose spans were never
                  written, after a SIGINT: its metrics.jsonl "time" less its eval's seconds)

"c/s window", all completions of the steps (128 a step) over the window, is the headline and
the base of every ratio and goal. "c/s median step" is 128 over the median step: from the end
of the previous step (or of the eval after it) to the end of this step's update, evals
excluded (millstream: the trainer's total_time); "evals s" is what the window holds besides
the steps (the window less the steps' own seconds: its evals). --minutes bounds the window the same way for
all: a peer stops after the first step that ends at or past it (millstream by SIGINT once its
metrics show one; a step it finished after that one is cut from its window). "@N s" accuracy
is the last eval of a model made at or before window second N (an eval sits at the end of the
step whose weights it evaluates); "command s" is the whole command, start-up and shutdown
included.

Resources, the same for every peer: its whole process tree is pinned to the same --cores CPUs
(the first N this process may use; sched_setaffinity in the child before exec, which every
process it starts inherits) and gets the same environment: OMP/MKL/OpenBLAS pools of N threads,
and with --device cpu CUDA_VISIBLE_DEVICES="" so that no process touches a GPU. ref and TRL
compute with N torch threads; millstream counts its cores from its affinity
(millstream.common.threads.machine_cores), sees N and splits them between its services itself
(the CPU budget line it printed is shown). With --device cuda, ref and TRL run their model on
the GPU and millstream's trainer sees it too (its engine stays on the CPU). The machine (CPU
model, cores given of all, memory), each peer's CPUs, device and threads, the commit and the
torch/transformers/trl versions are printed above the tables, stored in --out and printed
again by --report.

With several --seeds each (config, seed) is its own task (split, model, SFT) and the numbers
are means over seeds; --rounds 2 (the default) runs every peer twice per seed in ABBA order
(ref trl sync async async sync trl ref) and averages: this machine's speed drifts by 10-30%
over minutes, and the order keeps a drift from favouring the peers that ran in the faster
part of the run. The parity table lists every peer's greedy accuracy per eval step next to the
reference loop's, and the goals table issue 10's ratio goals for the config (with the peers
they need; c/s window) and whether sync's per-step accuracy stays within the eval's noise of
ref's (mean distance over the evals against 2 standard errors of a difference). Under each
ratio the bound that the measurements set, over the same window: the peer's steps at their
bound and the rest of its window (its evals) as measured. The step bound is the CPU work of a
step over the cores (async), or sync's rollout split into the engine's generation and the
hand-offs between the services, from the traces, with a train step as fast as ref's (sync
against TRL). Results, with every step and eval of every run, go to --out as JSON.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers_task as task  # noqa: E402
from proctree import MACHINE, STEAL, CpuSampler, cpu_list, git_commit, machine  # noqa: E402

PEERS = {
    "ref": "reference loop",
    "trl": "TRL GRPOTrainer",
    "sync": "millstream train",
    "async": "millstream train-async",
}
PROMPTS, SAMPLES = 16, 8
BATCH = PROMPTS * SAMPLES
MAX_STEPS = 10**6  # the step budget when --minutes sets the budget
EVAL_NAME = "arith"


@dataclass
class Spec:
    """One peer run: what the child process (or millstream) gets."""

    peer: str
    config: str
    seed: int
    model_dir: str
    train_path: str
    eval_path: str
    lr: float
    eval_every: int
    steps: int | None
    seconds: float | None  # the window's budget (--minutes)
    cpus: list[int]  # every peer's whole process tree runs on these
    device: str  # cpu | cuda
    out_dir: str


# -- what every peer gets -------------------------------------------------------------------

# Where millstream's services would send their spans instead of RUN_DIR/traces (or none at
# all): its window is read from those files, so no peer's environment keeps these.
TRACING_ENV = (
    "OTEL_SDK_DISABLED",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "MILLSTREAM_OTLP_ENDPOINT_IF_RESOLVES",
)
POOL_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Launch:
    """How a peer's command starts: its argv, its environment, and the CPUs its whole process
    tree is pinned to (in the child before exec: everything it starts inherits them)."""

    argv: list[str]
    env: dict[str, str]
    cpus: tuple[int, ...]

    @property
    def threads(self) -> int:
        """ref's and TRL's torch threads; the cores millstream splits between its services."""
        return len(self.cpus)

    def popen(self, **kwargs: Any) -> subprocess.Popen:
        pin = functools.partial(os.sched_setaffinity, 0, self.cpus)
        return subprocess.Popen(self.argv, env=self.env, preexec_fn=pin, cwd=REPO_ROOT, **kwargs)


def peer_env(cpus: list[int], device: str, base: Mapping[str, str]) -> dict[str, str]:
    """One environment for every peer: native pools of len(cpus) threads, spans to files and,
    on the CPU, no GPU visible."""
    env = {k: v for k, v in base.items() if k not in TRACING_ENV}
    env |= {name: str(len(cpus)) for name in POOL_ENV}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def launch(spec: Spec, base_env: Mapping[str, str]) -> Launch:
    if spec.peer in ("sync", "async"):
        argv = millstream_argv(spec, run_dir_of(spec))
    else:
        argv = [sys.executable, __file__, "--worker", str(Path(spec.out_dir) / "spec.json")]
    return Launch(argv, peer_env(spec.cpus, spec.device, base_env), tuple(spec.cpus))


def given_cpus(cores: int) -> list[int]:
    """The first `cores` of the CPUs this process may run on."""
    usable = sorted(os.sched_getaffinity(0))
    if not 1 <= cores <= len(usable):
        raise SystemExit(
            f"--cores {cores}: this process may use {len(usable)} CPUs ({cpu_list(usable)})"
        )
    return usable[:cores]


# -- recording (in-process peers) ------------------------------------------------------------


class Recorder:
    """Marks an in-process peer's window on the wall clock (module docstring): the start of
    the eval before step 1 and the end of every step's update; evaluates every `eval_every`
    steps and says when to stop."""

    def __init__(
        self, spec: Spec, evaluate: Callable[[], float], clock: Callable[[], float] = time.time
    ):
        self.spec, self.evaluate, self.clock = spec, evaluate, clock
        self.steps: list[dict] = []
        self.evals: list[dict] = []
        self.started = 0.0
        self._last = 0.0

    def start(self) -> None:
        self.started = self.clock()
        self._eval()
        self._last = self.clock()

    def step(self, reward: float, **parts: float) -> None:
        """A step's update ended now; `parts`: its rollout_s and train_s where the peer knows
        them."""
        now = self.clock()
        self.steps.append({"step": len(self.steps) + 1, "step_s": now - self._last, "end": now,
                           "reward": reward, **parts})  # fmt: skip
        if len(self.steps) % self.spec.eval_every == 0:
            self._eval()
        self._last = self.clock()

    def _eval(self) -> None:
        start = self.clock()
        accuracy = self.evaluate()
        self.evals.append({"step": len(self.steps), "accuracy": accuracy,
                           "eval_s": self.clock() - start})  # fmt: skip

    def done(self) -> bool:
        s = self.spec
        if s.steps:
            return len(self.steps) >= s.steps
        return bool(s.seconds and self.steps and self.steps[-1]["end"] - self.started >= s.seconds)

    def trace(self, **extra: Any) -> dict:
        return in_window(self.started, self.steps, self.evals, self.spec.seconds) | extra


def in_window(start: float, steps: list[dict], evals: list[dict], budget_s: float | None) -> dict:
    """A run's steps and evals on its window's clock (module docstring), the same for every
    peer: `start` is when the eval before step 1 began and each step's `end` when its update
    ended (time.time()); a step's `seconds` is its end in the window, an eval's the end of the
    step it evaluates. With a budget the window ends at the first step that ends at or past
    it; the steps after (millstream's, between its SIGINT and its stop) are cut."""
    kept: list[dict] = []
    for step in steps:
        kept.append(step | {"seconds": step["end"] - start})
        if budget_s and kept[-1]["seconds"] >= budget_s:
            break
    made_at = {0: 0.0} | {s["step"]: s["seconds"] for s in kept}
    evals = [e | {"seconds": made_at[e["step"]]} for e in evals if e["step"] in made_at]
    return {"start": start, "window_s": kept[-1]["seconds"] if kept else 0.0, "steps": kept,
            "evals": evals}  # fmt: skip


class PromptStream:
    """Prompts in a fresh seeded permutation per epoch."""

    def __init__(self, rows: list[dict], seed: int):
        import random

        self.rows, self.rng, self.order = rows, random.Random(seed), []

    def take(self, k: int) -> list[dict]:
        while len(self.order) < k:
            self.order += self.rng.sample(self.rows, len(self.rows))
        out, self.order = self.order[:k], self.order[k:]
        return out


# -- peer: the reference loop ---------------------------------------------------------------


def response_mask(response, eos_id: int):
    """1 on every response token up to and including the first eos, 0 after it (padding)."""
    is_eos = (response == eos_id).long()
    return ((is_eos.cumsum(dim=1) - is_eos) == 0).float()


def grpo_step(model, tokenizer, opt, batch: list[dict]) -> tuple[float, dict[str, float]]:
    """One rollout (n samples per prompt, T=1) and one Adam step; returns the mean reward and
    the seconds of the rollout (generate and reward) and of the update."""
    import torch

    start = time.perf_counter()
    prompts = [r["prompt"] for r in batch for _ in range(SAMPLES)]
    model.eval()
    ids, width = task.generate(
        model, tokenizer, prompts, sample=True, max_new_tokens=task.MAX_NEW_TOKENS
    )
    texts = tokenizer.batch_decode(ids[:, width:], skip_special_tokens=True)
    labels = [r["label"] for r in batch for _ in range(SAMPLES)]
    scores = [task.exact_match(t, y) for t, y in zip(texts, labels, strict=True)]
    rewards = torch.tensor(scores, device=ids.device)
    groups = rewards.view(-1, SAMPLES)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
    mask = response_mask(ids[:, width:], tokenizer.eos_token_id)
    rolled_out = time.perf_counter()
    # Every prompt has the same length here (no left padding), so positions need no offsets.
    model.train()
    logits = model(input_ids=ids).logits[:, width - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, width:, None]).squeeze(-1)
    loss = -(adv.view(-1, 1) * logp * mask).sum() / mask.sum()  # token mean over the batch
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    reward = rewards.mean().item()
    end = time.perf_counter()
    return reward, {"rollout_s": rolled_out - start, "train_s": end - rolled_out}


def run_reference(spec: Spec) -> dict:
    import torch

    torch.set_num_threads(len(spec.cpus))
    torch.manual_seed(spec.seed)
    model, tokenizer = task.load(Path(spec.model_dir))
    model.to(spec.device)
    eval_rows = task.read_jsonl(Path(spec.eval_path))
    prompts = PromptStream(task.read_jsonl(Path(spec.train_path)), spec.seed)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr, betas=(0.9, 0.999), eps=1e-8)
    rec = Recorder(spec, lambda: task.greedy_accuracy(model, tokenizer, eval_rows))
    rec.start()
    while not rec.done():
        reward, parts = grpo_step(model, tokenizer, opt, prompts.take(PROMPTS))
        rec.step(reward, **parts)
    return rec.trace(device=str(model.device), threads=f"{torch.get_num_threads()} torch threads")


# -- peer: TRL ------------------------------------------------------------------------------


def trl_version() -> str | None:
    try:
        from importlib.metadata import version

        import trl  # noqa: F401

        return version("trl")
    except ImportError:
        return None


def run_trl(spec: Spec) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(len(spec.cpus))
    model, tokenizer = task.load(Path(spec.model_dir))
    eval_rows = task.read_jsonl(Path(spec.eval_path))
    rec = Recorder(spec, lambda: task.greedy_accuracy(model, tokenizer, eval_rows))
    rewards: list[float] = []

    def exact_match(completions: list[str], label: list[str], **_: Any) -> list[float]:
        scores = [task.exact_match(c, y) for c, y in zip(completions, label, strict=True)]
        rewards.append(sum(scores) / len(scores))
        return scores

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            torch.set_num_threads(len(spec.cpus))
            rec.start()

        def on_step_end(self, args, state, control, **kwargs):
            rec.step(rewards[-1] if rewards else float("nan"))
            control.should_training_stop = rec.done()

    config = GRPOConfig(
        output_dir=str(Path(spec.out_dir) / "trl"), per_device_train_batch_size=BATCH,
        num_generations=SAMPLES, max_completion_length=task.MAX_NEW_TOKENS, temperature=1.0,
        top_k=0, top_p=1.0, learning_rate=spec.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=0.0, loss_type="dapo", scale_rewards="group", num_iterations=1,
        max_steps=spec.steps or MAX_STEPS, use_cpu=spec.device == "cpu", bf16=False, fp16=False,
        gradient_checkpointing=False, logging_steps=10**9, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=spec.seed, data_seed=spec.seed, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=exact_match, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_list(task.read_jsonl(Path(spec.train_path))), callbacks=[Timing()],
    )  # fmt: skip
    trainer.train()
    threads = f"{torch.get_num_threads()} torch threads"
    return rec.trace(trl_version=trl_version(), device=str(model.device), threads=threads)


# -- peers: millstream ----------------------------------------------------------------------


def millstream_argv(spec: Spec, run_dir: Path) -> list[str]:
    command = "train" if spec.peer == "sync" else "train-async"
    argv = [
        str(REPO_ROOT / ".venv" / "bin" / "millstream"), command,
        "--hf-checkpoint", spec.model_dir,
        "--prompt-data", spec.train_path, "--input-key", "prompt", "--label-key", "label",
        "--rollout-shuffle", "--rm-type", "exact",
        "--num-rollout", str(spec.steps or MAX_STEPS),
        "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
        "--global-batch-size", str(BATCH),
        "--rollout-max-response-len", str(task.MAX_NEW_TOKENS), "--rollout-temperature", "1.0",
        "--rollout-skip-special-tokens",
        "--eval-interval", str(spec.eval_every), "--eval-prompt-data", EVAL_NAME, spec.eval_path,
        "--n-samples-per-eval-prompt", "1", "--eval-temperature", "0",
        "--eval-max-response-len", str(task.MAX_NEW_TOKENS),
        "--micro-batch-size", str(BATCH),
        "--advantage-estimator", "grpo", "--calculate-per-token-loss",
        "--optimizer", "adam", "--lr", str(spec.lr), "--lr-decay-style", "constant",
        "--weight-decay", "0.0", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--clip-grad", "1.0",
        "--seed", str(spec.seed), "--rollout-seed", str(spec.seed),
        "--rollout-num-engines", "1", "--engine-max-running-requests", str(BATCH),
        "--rollout-max-concurrency", str(BATCH),
        "--run-id", f"peers-{spec.config}-{spec.peer}-s{spec.seed}", "--run-dir", str(run_dir),
        "--num-rollout-workers", "1", "--num-reward-workers", "1", "--log-level", "warning",
    ]  # fmt: skip
    if spec.peer == "async":
        # As `make run` does: a sync updates the engines in place instead of aborting the
        # generations in flight (which async mode would then redo).
        argv += ["--max-staleness", "1", "--pause-mode", "in_place"]
    return argv


def read_written(path: Path) -> list[dict]:
    """The rows of a JSONL file a running service writes, up to the line being written
    (task.read_jsonl is for finished files)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


def read_metrics(run_dir: Path) -> list[dict]:
    """Its iteration rows; a resumed trainer's `resumed_from` row (trainer/observe/history.py)
    is none (the runs here start fresh: no row is ever discarded)."""
    return [row for row in read_written(run_dir / "metrics.jsonl") if "step" in row]


def run_dir_of(spec: Spec) -> Path:
    return Path(spec.out_dir) / "run"


def run_millstream(spec: Spec) -> dict:
    run_dir = run_dir_of(spec)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log_path = Path(spec.out_dir) / "millstream.log"
    how = launch(spec, os.environ)
    stopped = False
    start, started_at = time.perf_counter(), time.time()
    with log_path.open("w") as log:
        proc = how.popen(stdout=log, stderr=subprocess.STDOUT)
        cpu = CpuSampler(proc.pid, cpus=how.cpus).start()
        while proc.poll() is None:
            time.sleep(0.5)
            if not stopped and spec.seconds and window_so_far(run_dir) >= spec.seconds:
                proc.send_signal(signal.SIGINT)  # the launcher stops every service
                stopped = True
        wall = time.perf_counter() - start
        cpu.stop()
    if proc.returncode != 0 and not stopped:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(
            f"{spec.peer} exited with {proc.returncode}; tail of {log_path}:\n{tail}"
        )
    budget = [
        "CPU budget:" + line.split("CPU budget:", 1)[1]
        for line in log_path.read_text().splitlines()
        if "CPU budget:" in line
    ]
    device = "cpu" if spec.device == "cpu" else "trainer cuda, engine cpu"
    trace = millstream_trace(run_dir, spec.seconds)
    return trace | {
        "wall_s": wall, "stopped_by_sigint": stopped, "device": device,
        "threads": budget[0] if budget else "its CPU budget line not found in the log",
        "cpu": cpu_profile(run_dir, cpu, started_at),
    }  # fmt: skip


def row_end(row: dict) -> float:
    """When an iteration's step ended by its metrics row (written after the eval, if any)."""
    return row["time"] - (row.get(f"eval/{EVAL_NAME}_seconds") or 0.0)


def spans_by_iteration(spans: list[dict], name: str) -> dict[int, dict]:
    return {s["attributes"]["millstream.iteration"]: s for s in spans if s["name"] == name}


def head_spans(run_dir: Path, lines: int = 5000) -> Iterator[dict]:
    """The first `lines` spans of the trainer's trace files, as far as they are written (a
    running trainer's last line may be torn)."""
    for path in (run_dir / "traces").glob("trainer-*.jsonl"):
        with path.open() as f:
            for _, line in zip(range(lines), f, strict=False):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    break


def window_start(run_dir: Path, lines: int = 5000) -> float | None:
    """The start of the trainer's eval before step 1 (time.time()), from the head of its trace
    file (None until that span is written)."""
    for span in head_spans(run_dir, lines):
        if span["name"] == "trainer.eval" and span["attributes"].get("millstream.iteration") == 0:
            return span["start_ns"] / 1e9
    return None


def window_so_far(run_dir: Path) -> float:
    """A running millstream's window seconds up to its last logged step (0 before one)."""
    rows = read_metrics(run_dir)
    start = window_start(run_dir) if rows else None
    return row_end(rows[-1]) - start if start is not None else 0.0


def millstream_window(rows: list[dict], spans: list[dict]) -> tuple[float, list[float]]:
    """The window's start and the end of each step in `rows` (time.time()), from the trainer's
    spans (module docstring)."""
    evals = spans_by_iteration(spans, "trainer.eval")
    if 0 not in evals:
        raise RuntimeError(
            "no trainer.eval span of iteration 0 in RUN_DIR/traces/trainer-*.jsonl: the window "
            "starts there (was tracing off, OTEL_SDK_DISABLED, or sent to an OTLP endpoint?)"
        )
    iteration_of = {
        s["span_id"]: it for it, s in spans_by_iteration(spans, "trainer.iteration").items()
    }
    synced = {iteration_of[s["parent_span_id"]]: s["end_ns"] / 1e9 for s in spans
              if s["name"] == "trainer.weight_sync" and s.get("parent_span_id") in iteration_of}  # fmt: skip
    # A step whose spans were not written (stopped by SIGINT): its metrics row, less its eval.
    ends = [synced.get(row["step"]) or row_end(row) for row in rows]
    return evals[0]["start_ns"] / 1e9, ends


def millstream_trace(run_dir: Path, budget_s: float | None) -> dict:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    rows, spans = read_metrics(run_dir), read_spans(run_dir, "trainer")
    start, ends = millstream_window(rows, spans)
    eval0 = spans_by_iteration(spans, "trainer.eval")[0]
    evals = [{"step": 0, "accuracy": c[2][EVAL_NAME],
              "eval_s": (eval0["end_ns"] - eval0["start_ns"]) / 1e9}
             for c in summary.get("eval_curve", []) if c[0] == 0]  # fmt: skip
    steps = []
    for row, end in zip(rows, ends, strict=True):
        steps.append({"step": row["step"], "step_s": row["total_time"], "end": end,
                      "reward": row.get("raw_reward"), "rollout_s": row.get("rollout_time"),
                      "train_s": row.get("train_time"), "sync_s": row.get("sync_time")})  # fmt: skip
        if f"eval/{EVAL_NAME}" in row:
            evals.append({"step": row["step"], "accuracy": row[f"eval/{EVAL_NAME}"],
                          "eval_s": row.get(f"eval/{EVAL_NAME}_seconds")})  # fmt: skip
    return in_window(start, steps, evals, budget_s) | {"summary": summary, "run_dir": str(run_dir)}


def first_request(run_dir: Path, lines: int = 5000) -> float | None:
    """When the trainer first asked for rollouts (time.time()): the start of its first eval or
    prompt hand-off span, from its trace file (None with tracing off)."""
    starts = [
        span["start_ns"] / 1e9
        for span in head_spans(run_dir, lines)
        if span["name"] == "trainer.eval"
        or (span["name"].startswith("send ") and span["name"].endswith(":prompts"))
    ]
    return min(starts, default=None)


def read_spans(run_dir: Path, service: str) -> list[dict]:
    return [s for p in (run_dir / "traces").glob(f"{service}-*.jsonl") for s in read_written(p)]


def engine_generation(run_dir: Path) -> float | None:
    """The median seconds per step the engines spent generating while the trainer waited
    for its batch: the union of the engines' generation spans inside each of the trainer's
    batch waits (None without traces). The rest of a sync step's rollout is hand-offs."""
    waits = [(s["start_ns"], s["end_ns"]) for s in read_spans(run_dir, "trainer")
             if s["name"] == "trainer.batch_wait"]  # fmt: skip
    gens = sorted((s["start_ns"], s["end_ns"]) for s in read_spans(run_dir, "engine")
                  if s["name"].startswith("text_completion"))  # fmt: skip
    per_step = []
    for start, end in waits:
        busy, reach = 0, start
        for a, b in gens:
            a, b = max(a, reach), min(b, end)
            if b > a:
                busy, reach = busy + b - a, b
        per_step.append(busy / 1e9)
    return statistics.median(per_step) if per_step else None


def cpu_profile(run_dir: Path, cpu: CpuSampler, started_at: float) -> dict:
    """Where the cores went: CPU seconds per role (trainer, engine, router, rollout, reward,
    redis) per step, over the steps whose rows are back to back (no eval or start-up between
    them), and by the first rollout request, which is `start_s` after the command started."""
    rows = read_metrics(run_dir)
    used: dict[str, float] = {}
    clean, wall = 0, 0.0
    for prev, row in itertools.pairwise(rows):
        gap = row["time"] - prev["time"]
        if gap - row["total_time"] > 0.02:  # the step ended with an eval (or a save)
            continue
        for role, seconds in cpu.between(prev["time"], row["time"]).items():
            used[role] = used.get(role, 0.0) + seconds
        clean, wall = clean + 1, wall + gap
    machine, steal = used.pop(MACHINE, 0.0), used.pop(STEAL, 0.0)
    first = first_request(run_dir)
    start_cpu = {
        r: v for r, v in (cpu.between(started_at, first) if first else {}).items()
        if r not in (MACHINE, STEAL)
    }  # fmt: skip
    return {
        "steps": clean,
        "step_wall_s": wall / clean if clean else None,
        "step_cpu_s": {r: v / clean for r, v in used.items()} if clean else {},
        # anything else on the machine meanwhile, and what the hypervisor took
        "step_other_s": (machine - sum(used.values())) / clean if clean else None,
        "step_steal_s": steal / clean if clean else None,
        "start_s": first - started_at if first else None,
        "start_cpu_s": start_cpu,
        "generation_s": engine_generation(run_dir),
    }


# -- running the peers ----------------------------------------------------------------------

WORKERS = {"ref": run_reference, "trl": run_trl}


def run_peer(spec: Spec) -> dict:
    """A trace: steps and evals in the window, the wall seconds of the whole command, and the
    CPUs, device and threads the peer ran with."""
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    placed = {"cpus": spec.cpus}
    if spec.peer in ("sync", "async"):
        return run_millstream(spec) | placed
    (out / "spec.json").write_text(json.dumps(asdict(spec)))
    start = time.perf_counter()
    log_path = out / "worker.log"
    with log_path.open("w") as log:
        code = launch(spec, os.environ).popen(stdout=log, stderr=subprocess.STDOUT).wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(
            f"{spec.peer} exited with {code}; tail of {log_path}:\n{log_path.read_text()[-3000:]}"
        )
    return json.loads((out / "trace.json").read_text()) | {"wall_s": wall} | placed


def worker_main(spec_path: Path) -> None:
    spec = Spec(**json.loads(spec_path.read_text()))
    trace = WORKERS[spec.peer](spec)
    (Path(spec.out_dir) / "trace.json").write_text(json.dumps(trace))


# -- summarising ----------------------------------------------------------------------------


def accuracy_at(trace: dict, key: str, value: float) -> float | None:
    """The last eval at or before step / window second `value` (None: the run never got
    there)."""
    if not trace["steps"] or trace["steps"][-1][key] < value:
        return None
    before = [e for e in trace["evals"] if e[key] <= value]
    return before[-1]["accuracy"] if before else None


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def median_of(key: str, rows: list[dict]) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


PARTS = ("rollout_s", "train_s", "sync_s", "step_s")  # of a step, where a peer records them


def summarise(traces: list[dict], at_steps: list[int], at_seconds: list[float]) -> dict:
    """A peer's runs: c/s over the window (all completions over all windows) and of the median
    step; `outside_s`, a window's seconds outside its steps (its evals), for the bounds."""
    step_s = [s["step_s"] for t in traces for s in t["steps"]]
    steps = [s for t in traces for s in t["steps"]]
    window_s = sum(t["window_s"] for t in traces)
    return {
        "steps": mean([len(t["steps"]) for t in traces]),
        "window_s": mean([t["window_s"] for t in traces]),
        "outside_s": mean([t["window_s"] - sum(s["step_s"] for s in t["steps"]) for t in traces]),
        "wall_s": mean([t["wall_s"] for t in traces]),
        "median_step_cps": BATCH / statistics.median(step_s) if step_s else None,
        "overall_cps": BATCH * len(steps) / window_s if window_s else None,
        "parts_s": {k: median_of(k, steps) for k in PARTS},
        "start_accuracy": mean([accuracy_at(t, "step", 0) for t in traces]),
        "acc_at_step": {s: mean([accuracy_at(t, "step", s) for t in traces]) for s in at_steps},
        "acc_at_seconds": {
            s: mean([accuracy_at(t, "seconds", s) for t in traces]) for s in at_seconds
        },
    }


def checkpoints(traces: dict[str, list[dict]], eval_every: int) -> tuple[list[int], list[float]]:
    """Steps and window seconds every run reached: a quarter, a half and all of the shortest
    run (every eval step when there are at most four)."""
    last_step = min(len(t["steps"]) for ts in traces.values() for t in ts)
    last_s = min(t["window_s"] for ts in traces.values() for t in ts if t["steps"])
    fractions = (0.25, 0.5, 1.0)
    steps = set(range(eval_every, last_step + 1, eval_every))
    if len(steps) > 4:
        steps = {math.floor(last_step * f / eval_every) * eval_every for f in fractions}
    return sorted(s for s in steps if s > 0), [math.floor(last_s * f * 10) / 10 for f in fractions]


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(
    config: str, rows: dict[str, dict], at_steps: list[int], at_seconds: list[float]
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{config}: {BATCH} completions/step, c/s over the wall-clock window (eval before "
        f"step 1 to the last step's end, evals included), greedy accuracy on {task.EVAL_SIZE} problems"
    )
    columns = ["peer", "steps", "window s", "evals s", "command s", "c/s median step"]
    columns += (
        ["c/s window"] + [f"@{s} steps" for s in at_steps] + [f"@{s:g} s" for s in at_seconds]
    )
    for col in [*columns, "x ref", "x TRL"]:
        table.add_column(col, justify="left" if col == "peer" else "right")
    ref, trl = rows.get("ref", {}).get("overall_cps"), rows.get("trl", {}).get("overall_cps")
    for peer, r in rows.items():
        cps = r["overall_cps"]
        table.add_row(
            PEERS[peer], fmt(r["steps"], ".0f"), fmt(r["window_s"], ".1f"), fmt(r["outside_s"], ".1f"),
            fmt(r["wall_s"], ".1f"), fmt(r["median_step_cps"], ".0f"), fmt(cps, ".0f"),
            *(fmt(r["acc_at_step"][s], ".1%") for s in at_steps),
            *(fmt(r["acc_at_seconds"][s], ".1%") for s in at_seconds),
            fmt(cps / ref if ref and cps else None, ".2f"), fmt(cps / trl if trl and cps else None, ".2f"),
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def parity(traces: dict[str, list[dict]]) -> list[dict]:
    """Per eval step: every peer's accuracy (mean over seeds) and its difference to ref's."""
    steps = sorted({e["step"] for ts in traces.values() for t in ts for e in t["evals"]})
    rows = []
    for step in steps:
        row: dict[str, Any] = {"step": step}
        for peer, ts in traces.items():
            accs = [e["accuracy"] for t in ts for e in t["evals"] if e["step"] == step]
            row[peer] = statistics.fmean(accs) if len(accs) == len(ts) else None
        rows.append(row)
    return rows


def print_parity(config: str, rows: list[dict], peers: list[str], seeds: list[int]) -> None:
    print(f"{config}: greedy accuracy per step, mean over seeds {seeds} (difference to ref)")
    print(f"{'step':>6}" + "".join(f"{p:>16}" for p in peers))
    for row in rows:
        cells = []
        for p in peers:
            v, ref = row.get(p), row.get("ref")
            diff = f" ({v - ref:+.1%})" if p != "ref" and v is not None and ref is not None else ""
            cells.append(f"{fmt(v, '.1%')}{diff}")
        print(f"{row['step']:>6}" + "".join(f"{c:>16}" for c in cells))


def profile(traces: list[dict]) -> dict | None:
    """A millstream peer's step and start-up, mean over seeds: the wall and CPU per role of a
    step between two evals (cpu_profile), the start-up, and the eval's median."""
    profiles = [t["cpu"] for t in traces if t.get("cpu", {}).get("steps")]
    if not profiles:
        return None
    roles = sorted({r for p in profiles for r in p["step_cpu_s"]})
    start_roles = sorted({r for p in profiles for r in p["start_cpu_s"]})
    return {
        "step_wall_s": mean([p["step_wall_s"] for p in profiles]),
        "step_cpu_s": {r: mean([p["step_cpu_s"].get(r, 0.0) for p in profiles]) for r in roles},
        "step_other_s": mean([p["step_other_s"] for p in profiles]),
        "step_steal_s": mean([p["step_steal_s"] for p in profiles]),
        "start_s": mean([p["start_s"] for p in profiles]),
        "start_cpu_s": {
            r: mean([p["start_cpu_s"].get(r, 0.0) for p in profiles if p["start_s"]])
            for r in start_roles
        },
        "eval_s": median_of("eval_s", [e for t in traces for e in t["evals"] if e["step"] > 0]),
        "generation_s": mean([p.get("generation_s") for p in profiles]),
    }


def print_cores(config: str, profiles: dict[str, dict], cores: int) -> None:
    """Per millstream peer: a step's wall, the cores it kept busy and each service's share."""
    from rich.console import Console
    from rich.table import Table

    if not profiles:
        return
    roles = sorted({r for p in profiles.values() for r in p["step_cpu_s"]})
    table = Table(title=f"{config}: where the {cores} cores go, per step between two evals (/proc)")
    columns = ["peer", "step ms", "cores busy", *(f"{r} ms" for r in roles), "all ms"]
    for col in [*columns, "not ours ms", "stolen ms"]:
        table.add_column(col, justify="left" if col == "peer" else "right")
    for peer, p in profiles.items():
        total = sum(p["step_cpu_s"].values())
        table.add_row(
            PEERS[peer], f"{p['step_wall_s'] * 1e3:.0f}", f"{total / p['step_wall_s']:.2f}",
            *(f"{p['step_cpu_s'].get(r, 0.0) * 1e3:.0f}" for r in roles), f"{total * 1e3:.0f}",
            f"{p['step_other_s'] * 1e3:.0f}", f"{p['step_steal_s'] * 1e3:.0f}",
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 200).print(table)


# Issue 10's goals per config: (ratio, numerator peer, denominator peer, at least).
GOALS = {
    "small": [("train-async / train", "async", "sync", 1.2), ("train / TRL", "sync", "trl", 0.9)],
    "medium": [("train-async / train", "async", "sync", 1.3), ("train / TRL", "sync", "trl", 1.0),
               ("train-async / TRL", "async", "trl", 1.2)],
}  # fmt: skip
START_GOAL_S = 5.0
EVAL_GOAL_S = {"small": 0.3}  # issue 10 measured the eval (~2 s) on the 0.79M model


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def steps_line(rows: dict[str, dict], peer: str) -> str:
    """A peer's median step and the medians of its parts."""
    if peer not in rows:
        return f"({peer} did not run)"
    parts = rows[peer]["parts_s"]
    names = {"rollout_s": "rollout", "train_s": "train", "sync_s": "weight sync"}
    known = [f"{names[k]} {ms(parts[k])}" for k in names if parts.get(k) is not None]
    return f"{peer}'s step {ms(parts['step_s'])} (medians: {', '.join(known)})"


def window_cps(rows: dict[str, dict], peer: str, step_s: float) -> float:
    """c/s over `peer`'s window had each of its steps taken `step_s`, the rest of the window
    (its evals) as measured: the bound a step bound sets on the window's c/s."""
    r = rows[peer]
    return BATCH * r["steps"] / (r["steps"] * step_s + r["outside_s"])


def limit_note(
    name: str, rows: dict[str, dict], profiles: dict[str, dict], cores: int
) -> str | None:
    """The measurement that bounds a ratio goal on this machine (over the window: the steps at
    their bound, the evals as measured), or says where the step goes."""
    sync, asyn = profiles.get("sync"), profiles.get("async")
    trl_cps = rows.get("trl", {}).get("overall_cps")
    trl_step = BATCH / rows["trl"]["median_step_cps"] if rows.get("trl") else None
    if name == "train-async / train" and sync and asyn:
        w, c = sync["step_wall_s"], sum(sync["step_cpu_s"].values())
        wa, ca = asyn["step_wall_s"], sum(asyn["step_cpu_s"].values())
        sync_cps = rows["sync"]["overall_cps"]
        return (
            f"limit: a sync step is {ms(c)} of CPU work in {ms(w)}; {cores} cores need at least "
            f"{ms(c / cores)} for it: async/sync <= {window_cps(rows, 'async', c / cores) / sync_cps:.2f}x "
            f"with sync's work; async's step did {ms(ca)} in {ms(wa)} ({ca / wa:.2f} of {cores} "
            f"cores busy): <= {window_cps(rows, 'async', ca / cores) / sync_cps:.2f}x with its own "
            "work (async's window with its steps that short, its evals as measured)"
        )  # fmt: skip
    if name == "train / TRL" and rows.get("sync"):
        note = f"{steps_line(rows, 'sync')}; {steps_line(rows, 'ref')}; TRL's step {ms(trl_step)}"
        parts = rows["sync"]["parts_s"]
        gen = sync.get("generation_s") if sync else None
        if gen is None or parts.get("rollout_s") is None or not (rows.get("ref") and trl_cps):
            return note
        # The train step is compute both loops share; the rest is the services' own: the
        # engine's generation, the hand-offs between the services around it, the weight sync.
        ref_train = rows["ref"]["parts_s"].get("train_s")
        if ref_train is None:
            return note
        handoffs, weights = max(0.0, parts["rollout_s"] - gen), parts.get("sync_s") or 0.0
        rollout = (
            f"sync's rollout is {ms(gen)} of generation and {ms(handoffs)} of hand-offs "
            "between the services"
        )
        if parts.get("train_s") is None or parts["train_s"] <= ref_train:
            return f"{note}. {rollout}"
        best = parts["rollout_s"] + ref_train + weights
        return (
            f"{note}. limit: {rollout}; with a train step as fast as ref's, it and the weight "
            f"sync make a {ms(best)} step: train/TRL <= {window_cps(rows, 'sync', best) / trl_cps:.2f}x "
            "(sync's window with such steps, its evals as measured)"
        )  # fmt: skip
    if name == "train-async / TRL" and rows.get("async"):
        note = f"{steps_line(rows, 'async')}; TRL's step {ms(trl_step)}"
        if not (asyn and trl_cps):
            return note
        work = sum(asyn["step_cpu_s"].values())
        return (
            f"{note}. limit: async's step is {ms(work)} of CPU work, at least {ms(work / cores)} "
            f"on {cores} cores: async/TRL <= {window_cps(rows, 'async', work / cores) / trl_cps:.2f}x "
            "(async's window with such steps, its evals as measured)"
        )  # fmt: skip
    return None


def goal_rows(
    config: str,
    rows: dict[str, dict],
    par: list[dict],
    seeds: int,
    profiles: dict[str, dict],
    cores: int,
) -> list[tuple]:
    """(goal, target, measured, met, limit or None) for each of the config's goals whose peers
    ran (c/s over the window); per-step learning: sync's mean distance to ref's accuracy
    over the evals after step 0, against twice the standard error of such a difference; and
    sync's start-up (the first rollout request after the command) and eval (median; the goal
    is for the small model's)."""
    out = []
    for name, top, bottom, target in GOALS.get(config, []):
        a, b = rows.get(top, {}).get("overall_cps"), rows.get(bottom, {}).get("overall_cps")
        if a and b:
            note = limit_note(name, rows, profiles, cores)
            out.append((name, f">= {target:.2f}x", f"{a / b:.2f}x", a / b >= target, note))
    diffs = [r["sync"] - r["ref"] for r in par
             if r["step"] > 0 and r.get("sync") is not None and r.get("ref") is not None]  # fmt: skip
    if diffs:
        level = statistics.fmean(r["ref"] for r in par if r.get("ref") is not None)
        noise = 2 * math.sqrt(2 * level * (1 - level) / (task.EVAL_SIZE * seeds))
        distance = statistics.fmean(abs(d) for d in diffs)
        out.append(("train's accuracy per step, to ref", f"within {noise:.1%} (2 SE)",
                    f"{distance:.1%} mean over {len(diffs)} evals", distance <= noise, None))  # fmt: skip
    sync = profiles.get("sync")
    if sync and sync["start_s"] is not None:
        used = sync["start_cpu_s"]
        total = sum(used.values())
        shares = ", ".join(f"{r} {v:.1f}" for r, v in sorted(used.items(), key=lambda kv: -kv[1]))
        note = (
            f"limit: by then the processes had used {total:.1f} s of CPU ({shares}): at least "
            f"{total / cores:.1f} s on {cores} cores"
        )
        out.append(("train's first rollout request", f"<= {START_GOAL_S:.1f} s",
                    f"{sync['start_s']:.1f} s after the command", sync["start_s"] <= START_GOAL_S, note))  # fmt: skip
    eval_goal = EVAL_GOAL_S.get(config)
    if sync and sync["eval_s"] is not None and eval_goal:
        out.append((f"train's {task.EVAL_SIZE}-problem eval", f"<= {eval_goal:.2f} s",
                    f"{sync['eval_s']:.2f} s (median)", sync["eval_s"] <= eval_goal, None))  # fmt: skip
    return out


def print_goals(config: str, goals: list[tuple]) -> None:
    if not goals:
        return
    print(f"{config}: issue 10's goals (c/s over the window; run with --peers ref,trl,sync,async)")
    for name, target, measured, met, note in goals:
        print(f"  {name:<36} {target:>22} {measured:>28}  {'met' if met else 'NOT met'}")
        if note:
            print(f"      {note}")


def resources(cpus: list[int], device: str) -> dict[str, Any]:
    """What every peer ran on: the machine, the CPUs and device given, the code, the libraries."""
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return machine() | {
        "cpus": cpus, "cores_given": len(cpus), "device": device, "gpu": gpu,
        "commit": git_commit(), "python": sys.version.split()[0], "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl_version(),
    }  # fmt: skip


def print_resources(res: dict[str, Any], traces: dict[str, list[dict]]) -> None:
    """The machine and code, then each peer's CPUs, device and threads as its runs recorded
    them (several when its runs differed)."""
    print(
        f"resources: {res['cpu_model']}, {res['cores_given']} of {res['cores_total']} cores given "
        f"(CPUs {cpu_list(res['cpus'])}), {res['memory_gib']:g} GiB memory, device "
        f"{res['device']}{' (' + res['gpu'] + ')' if res.get('gpu') else ''}; commit "
        f"{res['commit']}; torch {res['torch']}, transformers {res['transformers']}, "
        f"trl {res['trl'] or 'not installed'}"
    )
    for peer, ts in traces.items():
        seen = dict.fromkeys(
            f"CPUs {cpu_list(t.get('cpus', []))}, {t.get('device', '?')}, {t.get('threads', '?')}"
            for t in ts
        )
        print(f"  {PEERS[peer]:<24} {' | '.join(seen)}")


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs", default="small", help="comma list of: " + ", ".join(task.CONFIGS)
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="steps per peer (default 100)")
    budget.add_argument(
        "--minutes", type=float,
        help="wall minutes of each peer's window (evals included): it stops after the first "
        "step that ends at or past them",
    )  # fmt: skip
    parser.add_argument(
        "--peers", default=",".join(PEERS), help="comma list of: " + ", ".join(PEERS)
    )
    parser.add_argument("--seeds", default="0", help="comma list; each seed is its own task")
    parser.add_argument(
        "--rounds", type=int, default=2,
        help="runs per peer and seed, in ABBA order (2: ref trl sync async async sync trl ref)",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=3e-5, help="RL learning rate, every peer")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument(
        "--cores", type=int, default=len(os.sched_getaffinity(0)),
        help="CPUs every peer's process tree is pinned to, and ref's and TRL's torch threads; "
        "millstream splits them between its services (default: all this process may use)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu: no process of any peer sees a GPU; cuda: ref and TRL run their model on it "
        "and millstream's trainer sees it",
    )  # fmt: skip
    parser.add_argument("--cache", type=Path, default=REPO_ROOT / "runs" / "bench_peers")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "bench_vs_peers.json")
    parser.add_argument(
        "--report", type=Path, metavar="FILE",
        help="print the tables of a saved run (an --out file) again, running nothing",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps is None and args.minutes is None:
        args.steps = 100
    args.configs = args.configs.split(",")
    args.peers = args.peers.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    for name, known in (("configs", task.CONFIGS), ("peers", PEERS)):
        unknown = set(getattr(args, name)) - set(known)
        if unknown:
            parser.error(f"--{name}: unknown {sorted(unknown)}")
    return args


def torch_sees_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def run_order(peers: list[str], rounds: int) -> list[tuple[str, int]]:
    """(peer, round) in the order they run: forward, then backward, and so on (ABBA), so that
    a machine slowing down or speeding up through the run favours no peer."""
    order = []
    for r in range(rounds):
        order += [(p, r) for p in (peers if r % 2 == 0 else reversed(peers))]
    return order


def run_config(args: argparse.Namespace, config: str, peers: list[str]) -> dict:
    traces: dict[str, list[dict]] = {p: [] for p in peers}
    metas = {}
    for seed in args.seeds:
        t = task.build_task(config, seed, args.cache)
        metas[seed] = t.meta
        for peer, round_ in run_order(peers, args.rounds):
            spec = Spec(
                peer=peer, config=config, seed=seed, model_dir=str(t.model_dir),
                train_path=str(t.train_path), eval_path=str(t.eval_path), lr=args.lr,
                eval_every=args.eval_every, steps=args.steps,
                seconds=args.minutes * 60 if args.minutes else None, cpus=args.cpus,
                device=args.device,
                out_dir=str(args.cache / "runs" / f"{config}-seed{seed}" / f"{peer}{round_ or ''}"),
            )  # fmt: skip
            print(f"[{config} seed {seed} round {round_ + 1}] {PEERS[peer]} ...", flush=True)
            trace = run_peer(spec)
            if not any(e["step"] == 0 for e in trace["evals"]):  # millstream stopped by SIGINT
                start = {"step": 0, "seconds": 0.0, "accuracy": t.meta["start_accuracy"]}
                trace["evals"].insert(0, start | {"from": "task meta (HF greedy)"})
            last = trace["evals"][-1] if trace["evals"] else {}
            print(f"[{config} seed {seed} round {round_ + 1}] {PEERS[peer]}: {len(trace['steps'])} steps, "
                  f"{trace['window_s']:.1f} window s, {trace['wall_s']:.1f} command s, "
                  f"last eval {fmt(last.get('accuracy'), '.1%')} at step {last.get('step')}", flush=True)  # fmt: skip
            traces[peer].append(trace)
    return {"tasks": metas} | report_config(
        config, traces, args.seeds, args.eval_every, args.resources
    )


def report_config(
    config: str,
    traces: dict[str, list[dict]],
    seeds: list[int],
    eval_every: int,
    res: dict[str, Any],
) -> dict:
    """Print a config's tables, the resources above them, from its peers' traces (a run's,
    or a saved run's: --report)."""
    at_steps, at_seconds = checkpoints(traces, eval_every)
    rows = {p: summarise(ts, at_steps, at_seconds) for p, ts in traces.items()}
    par = parity(traces)
    print_resources(res, traces)
    print_table(config, rows, at_steps, at_seconds)
    print_parity(config, par, list(traces), seeds)
    profiles = {p: prof for p in ("sync", "async") if p in traces and (prof := profile(traces[p]))}
    print_cores(config, profiles, res["cores_given"])
    goals = goal_rows(config, rows, par, len(seeds), profiles, res["cores_given"])
    print_goals(config, goals)
    return {"summary": rows, "parity": par, "traces": traces, "profiles": profiles,
            "at_steps": at_steps, "at_seconds": at_seconds, "goals": goals}  # fmt: skip


def report(path: Path) -> None:
    """The tables of a saved run (its --out file), printed again by this version's code."""
    saved = json.loads(path.read_text())
    if "resources" not in saved:
        sys.exit(
            f"{path}: written before every peer was timed over the same wall-clock window "
            "(its seconds are train seconds, evals excluded); run the bench again"
        )
    settings, res = saved["settings"], saved["resources"]
    print(f"(from {path})")
    for config, result in saved["configs"].items():
        report_config(config, result["traces"], settings["seeds"], settings["eval_every"], res)


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(Path(sys.argv[2]))
        return
    args = parse_args(argv)
    if args.report:
        report(args.report)
        return
    peers = list(args.peers)
    if "trl" in peers and trl_version() is None:
        print("trl: skipped (not importable; pip install -e '.[peers]')")
        peers.remove("trl")
    if not peers:
        sys.exit("no peer left to run")
    if args.device == "cuda" and not torch_sees_gpu():
        sys.exit("--device cuda: torch sees no GPU here")
    args.cpus = given_cpus(args.cores)
    args.resources = resources(args.cpus, args.device)
    budget = f"{args.steps} steps" if args.steps else f"a {args.minutes:g}-minute window"
    print(f"settings: {PROMPTS} prompts x {SAMPLES} samples/step, lr {args.lr:g}, {budget} per peer, "
          f"eval every {args.eval_every} steps, seeds {args.seeds}, {args.rounds} round(s)")  # fmt: skip
    results = {config: run_config(args, config, peers) for config in args.configs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k != "resources"}  # fmt: skip
    args.out.write_text(json.dumps(
        {"resources": args.resources, "settings": settings, "configs": results}, indent=1
    ))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
