"""One row per iteration on stdout, as Miles prints it, and every metric in metrics.jsonl.

    [trainer] iter 12/300 | loss=0.412 reward=0.61 kl=0.018 | rollout=18.4s train=22.1s
              sync=2.1s (total 42.6s) | grad_norm=0.93 lr=1.0e-06     (one line)

metrics.jsonl gets one row per iteration, `{"step": N, "time": ..., <key>: value, ...}`, with
the keys the trainer computed (N counts iterations from 1, as the stdout row does), and a
resumed trainer's `{"resumed_from": C, ...}` row before its first (history.py: how to read it).

The tensorboard (--tensorboard-dir, --use-tensorboard) and wandb (--use-wandb) mirrors take
Miles' tags and x-axes, so a Miles dashboard reads a millstream run. What Miles does
(radixark/miles at 31f1ca96; THUDM/slime at 624b824a agrees):

- Tags. `train/<key>` for the loss dict of a training step, `train/grad_norm`, and the
  learning rate as `train/lr-pg_0` (miles/backends/training_utils/log_utils.py
  `log_train_step`; megatron_utils/model.py adds `lr-pg_{i}`). The loss dict's keys are
  loss_hub/losses.py's: loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl, ess_ratio,
  train_rollout_logprob_abs_diff, train_rollout_kl, kl_loss, tis, tis_clipfrac. The critic is
  a model of role "critic", whose tags `log_train_step` prefixes with `critic-`:
  `train/critic-value_loss`, `train/critic-value_clipfrac` (losses.py `value_loss_function`),
  `train/critic-grad_norm`, `train/critic-lr-pg_0`. So value, critic and ESS metrics are train
  metrics. `rollout/<key>` for the rollout's data: `rollout/raw_reward` (log_utils.py
  `log_rollout_data`), `rollout/response_len/{mean,max,min}`, `rollout/truncated_ratio`,
  `rollout/weight_version/min` (the samples' oldest weight version; miles/ray/rollout/
  metrics.py `log_rollout_data`). `perf/<timer>_time` (miles/utils/train_metric_utils.py
  `log_perf_data_raw`): `perf/rollout_time`, `perf/train_time`, `perf/update_weights_time`
  (the actor's `update_weights`, under @timer), `perf/step_time` (the whole step). `eval/<set>`
  (miles/ray/rollout/metrics.py `log_eval_rollout_data`).
- X-axes. Each namespace has its step key (miles/utils/tracking_utils/wandb_utils.py
  `_init_wandb_common`): train/* against `train/step` = rollout_id * num_steps_per_rollout +
  step_id; rollout/*, perf/*, multi_turn/*, passrate/* against `rollout/step` = rollout_id
  (metric_utils.py `compute_rollout_step`); eval/* against `eval/step` = the rollout_id of the
  eval (train.py: before training, rollout 0; after rollout r when (r + 1) % eval_interval ==
  0, r). rollout_id counts from 0. wandb gets `wandb.log(metrics)` with the step key inside
  and `define_metric(ns/*, step_metric=step key)`; tensorboard gets each tag at that step,
  without the step key itself (tracking_utils/base.py `TensorboardBackend.log`).

Here: iteration N is rollout N-1. The backend hands back a rollout's training metrics averaged
over its --num-steps-per-rollout optimizer steps; they are logged once, at the train/step of
its last step (with one step per rollout, the default, train/step is the rollout_id, as in
Miles). The keys of a row go to their tags by TAGS, below; a key already namespaced (`eval/...`)
is its own tag; any other key is logged under rollout/ with a warning (the unit tests hold
every key the trainer computes to TAGS). Millstream's own counters (admitted, trained, ...)
have no Miles name and go under rollout/, on the rollout axis. The eval metrics of a row are
mirrored by `log_eval`, which the trainer calls for every eval (the one before training too).
--custom-rollout-log-function-path and --custom-eval-rollout-log-function-path: log_hooks.py.
--log-passrate adds Miles' pass@k (`pass_at_k`): `passrate/pass@k` to each row, from the
iteration's groups, and `eval/<set>-pass@k` to each eval's metrics.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from millstream.common.config import ConfigError, RunConfig
from millstream.common.config.schema import to_dict
from millstream.common.config.store import without_secrets
from millstream.common.errors import MillstreamError
from millstream.compat.miles import make_args, miles_samples, tracking

from . import history, log_hooks

log = logging.getLogger(__name__)

# The package each tracking flag needs; pyproject.toml's `track` extra ships them
# (pip install 'millstream[track]'), and preflight checks them before anything starts. The
# tensorboard writer is tensorboard's own (torch.utils.tensorboard wraps the same one).
TRACKING_PACKAGES = {
    "--tensorboard-dir": "tensorboard",
    "--use-tensorboard": "tensorboard",
    "--use-wandb": "wandb",
}
TRACK_EXTRA = "track"

_TRAIN = (
    "loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy_loss", "grad_norm", "tis",
    "tis_clipfrac", "ess_ratio", "train_rollout_logprob_abs_diff", "train_rollout_kl",
)  # fmt: skip
_COUNTS = (
    "admitted", "trained", "filtered", "failed", "dropped_stale", "dropped_at_end", "in_flight",
    "duplicates", "dead_letters", "version", "engines_removed", "staleness_mean", "staleness_max",
)  # fmt: skip

# A row's key -> its tag in tensorboard and wandb (Miles' name where Miles has the metric).
TAGS: dict[str, str] = {
    **{key: f"train/{key}" for key in _TRAIN},
    "lr": "train/lr-pg_0",
    "value_loss": "train/critic-value_loss",
    "value_clipfrac": "train/critic-value_clipfrac",
    "critic_grad_norm": "train/critic-grad_norm",
    "critic_lr": "train/critic-lr-pg_0",
    "raw_reward": "rollout/raw_reward",
    "response_len_mean": "rollout/response_len/mean",
    "response_len_max": "rollout/response_len/max",
    "response_len_min": "rollout/response_len/min",
    "truncated_ratio": "rollout/truncated_ratio",
    "behavior_version_min": "rollout/weight_version/min",
    **{key: f"rollout/{key}" for key in _COUNTS},
    "rollout_time": "perf/rollout_time",
    "train_time": "perf/train_time",
    "sync_time": "perf/update_weights_time",
    "colocate_time": "perf/colocate_time",
    "total_time": "perf/step_time",
    "completions_per_s": "perf/completions_per_s",
}

# Each namespace's step key (Miles' _init_wandb_common).
STEP_KEYS = {
    "train": "train/step",
    "rollout": "rollout/step",
    "perf": "rollout/step",
    "multi_turn": "rollout/step",
    "passrate": "rollout/step",
    "eval": "eval/step",
}
WANDB_DEFINE_METRICS = (
    ("train/*", "train/step"),
    ("rollout/*", "rollout/step"),
    ("multi_turn/*", "rollout/step"),
    ("passrate/*", "rollout/step"),
    ("eval/*", "eval/step"),
    ("perf/*", "rollout/step"),
)
NOT_LOGGED = ("group_ids",)  # in metrics.jsonl only: not a number

_warned: set[str] = set()


def tag(key: str) -> str:
    """The tag of a row's key (module docstring)."""
    if key in TAGS:
        return TAGS[key]
    if key.split("/", 1)[0] in STEP_KEYS and "/" in key:
        return key
    if key not in _warned:
        _warned.add(key)
        log.warning("metric %r has no tag in metrics.TAGS: logged as rollout/%s", key, key)
    return f"rollout/{key}"


def _number(value: Any) -> bool:
    """A value a log row and its mirrors take: a real number (bools are not)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def namespaced(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a row by tag."""
    return {
        tag(key): value
        for key, value in metrics.items()
        if isinstance(value, int | float) and key not in NOT_LOGGED
    }


def step_key(tag_: str) -> str:
    return STEP_KEYS[tag_.split("/", 1)[0]]


def train_step(cfg: RunConfig, rollout_id: int) -> int:
    """train/step of a rollout's training metrics: its last optimizer step's."""
    n = cfg.rollout.num_steps_per_rollout or 1
    return rollout_id * n + n - 1


def tensorboard_dir(
    cfg: RunConfig, environ: Mapping[str, str] | None = None, now: datetime.datetime | None = None
) -> str | None:
    """Where tensorboard events go: --tensorboard-dir; with --use-tensorboard, Miles' rule
    (tracking_utils/tensorboard_utils.py): TENSORBOARD_DIR, else
    tensorboard_log/<--tb-project-name>/<--tb-experiment-name or the start time>."""
    lg = cfg.logging
    if lg.tensorboard_dir:
        return lg.tensorboard_dir
    if not lg.use_tensorboard:
        return None
    env = os.environ if environ is None else environ
    if env.get("TENSORBOARD_DIR"):
        return env["TENSORBOARD_DIR"]
    if not lg.tb_project_name:
        raise ConfigError(
            "--use-tensorboard needs --tb-project-name, TENSORBOARD_DIR or --tensorboard-dir: "
            "where to write the events"
        )
    started = (now or datetime.datetime.now()).strftime("%Y%m%d_%H%M%S")
    experiment = lg.tb_experiment_name or started
    return os.path.join("tensorboard_log", lg.tb_project_name, experiment)


def wandb_init_kwargs(
    cfg: RunConfig, run_dir: Path, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """wandb.init's arguments, as Miles' init_wandb_primary builds them (wandb_utils.py), with
    `settings` a dict for wandb.Settings. The API key (--wandb-key, else WANDB_API_KEY) goes
    only into the settings of an online run: never into the run's config, which is the
    published RunConfig (no secrets), nor into ~/.netrc (Miles' wandb.login writes it there)."""
    lg = cfg.logging
    env = os.environ if environ is None else environ
    mode = lg.wandb_mode or env.get("WANDB_MODE") or "online"
    settings: dict[str, Any] = {"mode": mode, "init_timeout": 300.0}
    if mode == "online":
        key = lg.wandb_key or env.get("WANDB_API_KEY")
        if key:
            settings["api_key"] = key
        if lg.wandb_host:
            settings["base_url"] = lg.wandb_host
    return {
        "entity": lg.wandb_team,
        "project": lg.wandb_project,
        "group": lg.wandb_group,
        "name": cfg.run_id,
        "dir": lg.wandb_dir or str(run_dir),
        "config": to_dict(without_secrets(cfg)),
        "settings": settings,
    }


def pass_at_k(rewards: list[float], group_size: int) -> dict[str, float]:
    """Miles' compute_pass_rate: `rewards` in consecutive groups of `group_size`; a sample
    passes with reward 1. Per group of n with c passing, the unbiased estimate
    pass@k = 1 - C(n - c, k) / C(n, k), averaged over the groups, for k = 1, 2, 4, ... <= n
    (nothing for groups of one)."""
    n = group_size
    if n < 2 or not rewards or len(rewards) % n:
        return {}
    passing = [sum(r == 1 for r in rewards[i : i + n]) for i in range(0, len(rewards), n)]
    out = {}
    for k in (2**i for i in range(int(math.log2(n)) + 1)):
        estimates = (1.0 - math.comb(n - c, k) / math.comb(n, k) for c in passing)
        out[f"pass@{k}"] = statistics.fmean(estimates)
    return out


def format_row(iteration: int, total: int, m: dict[str, float]) -> str:
    return (
        f"[trainer] iter {iteration}/{total} | loss={m.get('loss', 0):.3f} reward={m.get('raw_reward', 0):.2f} "
        f"kl={m.get('kl_loss', 0):.3f} | rollout={m.get('rollout_time', 0):.1f}s train={m.get('train_time', 0):.1f}s "
        f"sync={m.get('sync_time', 0):.1f}s (total {m.get('total_time', 0):.1f}s) | "
        f"grad_norm={m.get('grad_norm', 0):.2f} lr={m.get('lr', 0):.1e}"
    )


class TensorboardWriter:
    """Scalars into tensorboard's event files, with tensorboard's own writer."""

    def __init__(self, logdir: str):
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as err:
            raise MillstreamError(
                f"tensorboard logging needs the tensorboard package ({err}): "
                f"pip install 'millstream[{TRACK_EXTRA}]'"
            ) from None
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(logdir)

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        self._writer.add_event(event)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg = cfg
        self.args = make_args(without_secrets(cfg))  # the custom log functions' Miles `args`
        hooks = log_hooks.hooks(cfg)
        self._rollout_hook = hooks.get(log_hooks.ROLLOUT)
        self._eval_hook = hooks.get(log_hooks.EVAL)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        history.end_partial_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb: TensorboardWriter | None = None
        self._wandb: Any = None
        try:
            logdir = tensorboard_dir(cfg)
            if logdir:
                self._tb = TensorboardWriter(logdir)
            if cfg.logging.use_wandb:
                self._wandb = _init_wandb(cfg, run_dir)
        except BaseException:
            self.close()
            raise

    def log(
        self,
        step: int,
        metrics: dict[str, Any],
        row: str | None = None,
        *,
        groups: list[Any] | None = None,
    ) -> None:
        """Iteration `step` (from 1): its row to metrics.jsonl; train/, rollout/ and perf/ to
        the mirrors (the eval/ keys are `log_eval`'s); `groups`, the iteration's ScoredGroups,
        give the custom rollout log function its samples (and --log-passrate its rewards)."""
        if self.cfg.logging.log_passrate and groups:
            rewards = [s.reward for g in groups for s in g.group.samples]
            n = self.cfg.rollout.n_samples_per_prompt or 1
            metrics = {**metrics, **{f"passrate/{k}": v for k, v in pass_at_k(rewards, n).items()}}
        rollout_id = step - 1
        tags = {t: v for t, v in namespaced(metrics).items() if not t.startswith("eval/")}
        train = {t: v for t, v in tags.items() if step_key(t) == "train/step"}
        rest = {t: v for t, v in tags.items() if step_key(t) == "rollout/step"}
        logged: dict[str, Any] = {}
        if self._rollout_hook is not None:
            samples = [s for g in groups or () for s in miles_samples(g.group)]
            extra = {t: v for t, v in rest.items() if t.startswith("rollout/")}
            rollout_time = metrics.get("rollout_time", 0.0)
            with tracking.collect() as logged:  # Miles' tracking.log inside the function
                skip = self._rollout_hook(rollout_id, self.args, samples, extra, rollout_time)
            if skip:
                rest = {t: v for t, v in rest.items() if not t.startswith("rollout/")}
            logged = {t: v for t, v in logged.items() if _number(v)}
            rest |= logged
        record = {"step": step, "time": time.time(), **metrics, **logged}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._mirror(train, "train/step", train_step(self.cfg, rollout_id))
        self._mirror(rest, "rollout/step", rollout_id)
        if row:
            print(row, flush=True)

    def mark_resume(self, iteration: int) -> dict[str, Any]:
        """Before the first row of a trainer resumed from the checkpoint of `iteration`: the
        resume row (history.py), naming the rows after it that the killed process wrote."""
        row = history.read(self.path, strict=False).resume_row(iteration)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        steps = row["discarded_iterations"]
        if steps:
            which = (
                f"iteration {steps[0]}" if len(steps) == 1 else f"iterations {steps[0]}-{steps[-1]}"
            )
            print(
                f"[trainer] metrics.jsonl: {which} after the checkpoint of iteration {iteration} "
                f"discarded ({row['discarded_trained']} groups trained there): trained again",
                flush=True,
            )
        return row

    def log_eval(
        self, iteration: int, metrics: dict[str, Any], data: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """An eval after `iteration` iterations (0: before training): its eval/ metrics to the
        mirrors at Miles' eval/step; `data` ({set: {"rewards", "truncated", "samples"}}) is
        for the custom eval log function and --log-passrate, whose eval/<set>-pass@k it
        returns (for the row)."""
        rollout_id = max(iteration - 1, 0)
        extra: dict[str, float] = {}
        if self.cfg.logging.log_passrate:
            n = self.cfg.eval.n_samples_per_eval_prompt
            for name, d in (data or {}).items():
                found = pass_at_k(list(d.get("rewards", ())), n)
                extra |= {f"eval/{name}-{k}": v for k, v in found.items()}
        tags = {t: v for t, v in namespaced({**metrics, **extra}).items() if t.startswith("eval/")}
        if self._eval_hook is not None:
            with tracking.collect() as logged:  # Miles' tracking.log inside the function
                skip = self._eval_hook(rollout_id, self.args, data or {}, dict(tags))
            logged = {t: v for t, v in logged.items() if _number(v)}
            extra |= logged
            if skip:
                self._mirror(logged, "eval/step", rollout_id)
                return extra
            tags |= logged
        self._mirror(tags, "eval/step", rollout_id)
        return extra

    def _mirror(self, tags: dict[str, float], key: str, step: int) -> None:
        if not tags:
            return
        if self._tb is not None:
            self._tb.add_scalars(tags, step)
        if self._wandb is not None:
            self._wandb.log({**tags, key: step})

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _init_wandb(cfg: RunConfig, run_dir: Path) -> Any:
    try:
        import wandb
    except ImportError:
        raise MillstreamError(
            f"--use-wandb needs the wandb package: pip install 'millstream[{TRACK_EXTRA}]'"
        ) from None
    kwargs = wandb_init_kwargs(cfg, run_dir)
    Path(kwargs["dir"]).mkdir(parents=True, exist_ok=True)
    kwargs["settings"] = wandb.Settings(**kwargs["settings"])
    try:
        run = wandb.init(**kwargs)
    except Exception as err:  # e.g. online without a key: one line, not wandb's traceback
        mode = kwargs["settings"].mode
        raise MillstreamError(
            f"--use-wandb: wandb.init ({mode}) failed: {type(err).__name__}: {err}"
        ) from err
    for pattern, key in WANDB_DEFINE_METRICS:
        run.define_metric(key)
        run.define_metric(pattern, step_metric=key)
    return run
