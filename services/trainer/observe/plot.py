"""`millstream plot RUN_DIR [--compare RUN_DIR2 ...] [--out DIR]`: a run's curves as PNG files.

Reads RUN_DIR/metrics.jsonl (one row per iteration, written by MetricsLogger; after a resume,
the rows as history.py reads them) and writes one figure per theme into --out (default
RUN_DIR/plots/):

    reward.png      raw_reward and eval accuracy (eval/<set>) by iteration and by wall-clock
                    seconds since the first row
    losses.png      loss, KL (kl_loss, ppo_kl, train_rollout_kl), entropy_loss, grad_norm
    timings.png     rollout / train / sync seconds per iteration, stacked, total_time on top
    throughput.png  staleness, completions/s, response length

--compare overlays other runs on the same axes (timings: one panel per run, as stacks do not
overlay), each named by its directory. A key no run has, or a non-numeric value, is left out;
a panel with nothing to draw is dropped, and so is a figure with no panel.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from millstream.common.errors import MillstreamError

from . import history

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

XLABELS = {"step": "iteration", "seconds": "seconds since the first iteration"}
# What evaluate.py logs next to each eval set's accuracy eval/<set>.
EVAL_EXTRAS = ("_reward", "_failed_groups", "_seconds")
TIMING_KEYS = ("rollout_time", "train_time", "sync_time")
LINESTYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    by: str = "step"  # the x axis: "step" (iteration) or "seconds" (wall clock)


LOSS_PANELS = (
    Panel("loss", ("loss",)),
    Panel("KL", ("kl_loss", "ppo_kl", "train_rollout_kl")),
    Panel("entropy", ("entropy_loss",)),
    Panel("grad norm", ("grad_norm",)),
)
THROUGHPUT_PANELS = (
    Panel("staleness (policy versions)", ("staleness_mean", "staleness_max")),
    Panel("completions/s", ("completions_per_s",)),
    Panel("response length (tokens)", ("response_len_mean", "response_len_max")),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass
class Run:
    name: str
    rows: list[dict[str, Any]]

    @cached_property
    def start(self) -> float:
        """The first row's unix time: wall-clock curves count seconds from there."""
        return next((t for row in self.rows if (t := _number(row.get("time"))) is not None), 0.0)

    def series(self, key: str, by: str = "step") -> tuple[list[float], list[float]]:
        """The rows' numeric values of `key`, against iterations or seconds since the start."""
        xs, ys = [], []
        for row in self.rows:
            x = _number(row.get("time" if by == "seconds" else "step"))
            y = _number(row.get(key))
            if x is not None and y is not None:
                xs.append(x - self.start if by == "seconds" else x)
                ys.append(y)
        return xs, ys

    def has(self, key: str) -> bool:
        return any(_number(row.get(key)) is not None for row in self.rows)


def load_run(run_dir: Path, name: str | None = None) -> Run:
    """The run's rows as its history stands: after a resume, an iteration's rows from the
    process that was killed give way to the resumed one's (history.py)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise MillstreamError(f"{path} not found: is {run_dir} a run's --run-dir?")
    rows = history.read(path).rows
    if not rows:
        raise MillstreamError(f"{path} is empty: the run has not finished an iteration yet")
    return Run(name or run_dir.resolve().name, rows)


def eval_keys(runs: Sequence[Run]) -> list[str]:
    """The eval accuracy keys eval/<set>, not the extras logged next to them."""
    keys = dict.fromkeys(key for run in runs for row in run.rows for key in row)
    return [
        key
        for key in keys
        if key.startswith("eval/")
        and not any(key.endswith(s) and key.removesuffix(s) in keys for s in EVAL_EXTRAS)
    ]


def _draw_panel(ax: Axes, panel: Panel, keys: list[str], runs: Sequence[Run]) -> None:
    for r, run in enumerate(runs):
        for k, key in enumerate(keys):
            xs, ys = run.series(key, panel.by)
            if not xs:
                continue
            label = ": ".join(
                ([run.name] if len(runs) > 1 else []) + ([key] if len(keys) > 1 else [])
            )
            # Compared runs keep one colour each; a run's keys differ by line style.
            color = f"C{r}" if len(runs) > 1 else f"C{k}"
            # Eval rows come every --eval-interval iterations: markers show where.
            marker = "o" if key.startswith("eval/") else None
            style = LINESTYLES[k % len(LINESTYLES)]
            ax.plot(xs, ys, style, color=color, marker=marker, ms=3, lw=1.2, label=label)
    ax.set_title(panel.title)
    _style_axes(ax, panel.by)
    if len(runs) > 1 or len(ax.get_lines()) > 1:
        ax.legend(fontsize="small")


def _style_axes(ax: Axes, by: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(XLABELS[by])
    if by == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _new_figure(title: str, width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    # Fixed margins (inches) instead of layout="constrained", which doubles each savefig's
    # time; the text around these panels is short and predictable.
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(
        left=0.75 / width, right=1 - 0.2 / width, bottom=0.55 / height, top=1 - 0.75 / height,
        wspace=0.22, hspace=0.45,
    )  # fmt: skip
    fig.suptitle(title)
    return fig


def _any_has(runs: Sequence[Run], key: str) -> bool:
    return any(run.has(key) for run in runs)


def _panels_figure(
    title: str, panels: Sequence[Panel], runs: Sequence[Run], ncols: int
) -> Figure | None:
    drawn = [(p, keys) for p in panels if (keys := [k for k in p.keys if _any_has(runs, k)])]
    if not drawn:
        return None
    ncols = min(ncols, len(drawn))
    nrows = math.ceil(len(drawn) / ncols)
    fig = _new_figure(title, 5.0 * ncols, 3.6 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).flat
    for ax, (panel, keys) in zip(axes, drawn, strict=False):
        _draw_panel(ax, panel, keys, runs)
    for ax in axes[len(drawn) :]:
        ax.remove()
    return fig


def _timings_figure(title: str, runs: Sequence[Run]) -> Figure | None:
    stacked = [(run, keys) for run in runs if (keys := [k for k in TIMING_KEYS if run.has(k)])]
    if not stacked:
        return None
    fig = _new_figure(title, 5.5 * len(stacked), 3.8)
    axes = fig.subplots(1, len(stacked), squeeze=False, sharey=True)[0]
    for ax, (run, keys) in zip(axes, stacked, strict=True):
        steps = [row["step"] for row in run.rows]
        # A row missing one phase still stacks: the phase counts as 0 s there.
        layers = [[_number(row.get(key)) or 0.0 for row in run.rows] for key in keys]
        labels = [key.removesuffix("_time") for key in keys]
        ax.stackplot(steps, *layers, labels=labels, colors=["C0", "C1", "C2"], alpha=0.8)
        if run.has("total_time"):
            ax.plot(*run.series("total_time"), color="black", lw=1, label="total")
        if len(runs) > 1:
            ax.set_title(run.name)
        _style_axes(ax, "step")
        ax.legend(fontsize="small", loc="upper right")
    axes[0].set_ylabel("seconds")
    return fig


def build_figures(runs: Sequence[Run]) -> dict[str, Figure]:
    """File stem -> Figure, for each theme some run has data for."""
    title = " vs ".join(run.name for run in runs)
    rewards = ("raw_reward", *eval_keys(runs))
    figures = {
        "reward": _panels_figure(
            f"{title}: reward and eval accuracy",
            (Panel("by iteration", rewards), Panel("by wall clock", rewards, by="seconds")),
            runs,
            ncols=2,
        ),
        "losses": _panels_figure(f"{title}: training", LOSS_PANELS, runs, ncols=2),
        "timings": _timings_figure(f"{title}: time per iteration", runs),
        "throughput": _panels_figure(f"{title}: throughput", THROUGHPUT_PANELS, runs, ncols=3),
    }
    return {stem: fig for stem, fig in figures.items() if fig is not None}


def _run_names(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name; the paths as given when two names are the same."""
    names = [path.resolve().name for path in run_dirs]
    return names if len(set(names)) == len(names) else [str(path) for path in run_dirs]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="millstream plot",
        description="Draw a run's metrics.jsonl as PNG files (reward, losses, timings, "
        "throughput).",
        allow_abbrev=False,
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's --run-dir")
    parser.add_argument(
        "--compare",
        nargs="+",
        action="extend",
        type=Path,
        default=[],
        metavar="RUN_DIR",
        help="other runs to overlay on the same axes, named by their directory",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="where the PNG files go (default RUN_DIR/plots)"
    )
    parser.add_argument("--dpi", type=int, default=100, help="resolution (default 100)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_dirs = [args.run_dir, *args.compare]
    runs = [load_run(path, name) for path, name in zip(run_dirs, _run_names(run_dirs), strict=True)]
    try:
        import matplotlib
    except ImportError:
        raise MillstreamError(
            "`millstream plot` needs matplotlib: pip install 'millstream[track]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display, whatever MPLBACKEND says
    figures = build_figures(runs)
    if not figures:
        files = ", ".join(str(path / "metrics.jsonl") for path in run_dirs)
        raise MillstreamError(f"nothing to plot: no metric this draws in {files}")
    out = args.out or args.run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    for stem, fig in figures.items():
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=args.dpi)
        print(path)
    return 0
