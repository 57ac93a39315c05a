"""`millstream plot`: PNG files per theme from a run's metrics.jsonl, runs overlaid and named
by their directory, missing or non-numeric metrics skipped, bad files named with their line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from millstream import cli
from millstream.common.errors import MillstreamError
from millstream.trainer.observe import plot
from millstream.trainer.observe.plot import build_figures, load_run, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
THEMES = ("reward", "losses", "timings", "throughput")
T0 = 1_795_453_872.0


def _row(step: int, reward: float) -> dict:
    """A row as MetricsLogger writes it for the arith example (trimmed), eval every 2nd step."""
    row = {
        "step": step, "time": T0 + 1.5 * step, "raw_reward": reward,
        "response_len_mean": 3.6, "response_len_max": 4, "staleness_mean": 1.0,
        "staleness_max": 1, "loss": -0.01 * step, "train_rollout_kl": 0.01, "ppo_kl": 0.0,
        "entropy_loss": 0.15, "grad_norm": 1.8, "lr": 0.0005, "rollout_time": 0.1,
        "train_time": 0.7, "sync_time": 0.2, "total_time": 1.0, "completions_per_s": 300.0 + step,
        "group_ids": ["e0-i4980", "e0-i4704"],
    }  # fmt: skip
    if step % 2 == 0:
        row |= {"eval/arith": reward + 0.1, "eval/arith_reward": reward + 0.1,
                "eval/arith_failed_groups": 0, "eval/arith_seconds": 1.5}  # fmt: skip
    return row


def _write_run(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    lines = (json.dumps(row) + "\n" for row in rows)
    (run_dir / "metrics.jsonl").write_text("".join(lines), encoding="utf-8")
    return run_dir


def _legend(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def _axes(fig, title: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title() == title]
    return ax


def test_main_writes_one_png_per_theme(tmp_path, capsys):
    run = _write_run(tmp_path / "arith", [_row(step, 0.4 + 0.05 * step) for step in range(1, 7)])
    assert main([str(run), "--dpi", "40"]) == 0
    paths = [run / "plots" / f"{theme}.png" for theme in THEMES]
    assert capsys.readouterr().out.split() == [str(path) for path in paths]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, path


def test_reward_is_drawn_by_iteration_and_by_seconds_since_the_first_row(tmp_path):
    rows = [_row(step, 0.1 * step) for step in range(1, 5)]
    fig = build_figures([load_run(_write_run(tmp_path / "arith", rows))])["reward"]
    by_step, by_seconds = _axes(fig, "by iteration"), _axes(fig, "by wall clock")
    assert _legend(by_step) == ["raw_reward", "eval/arith"]  # not the eval/arith_* extras
    reward, accuracy = by_step.get_lines()
    assert list(reward.get_xdata()) == [1, 2, 3, 4]
    assert list(reward.get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert list(accuracy.get_xdata()) == [2, 4]
    assert list(accuracy.get_ydata()) == pytest.approx([0.3, 0.5])
    assert list(by_seconds.get_lines()[0].get_xdata()) == pytest.approx([0.0, 1.5, 3.0, 4.5])


def test_compare_overlays_runs_named_by_their_directory(tmp_path):
    sync = _write_run(tmp_path / "sync", [_row(step, 0.2) for step in range(1, 5)])
    fast = [_row(step, 0.6) for step in range(1, 4)]
    for row in fast:
        del row["sync_time"]  # a run without one phase still stacks the others
    async_ = _write_run(tmp_path / "async", fast)

    figures = build_figures([load_run(sync), load_run(async_)])
    assert list(figures) == list(THEMES)
    by_step = _axes(figures["reward"], "by iteration")
    assert _legend(by_step) == [
        "sync: raw_reward", "sync: eval/arith", "async: raw_reward", "async: eval/arith",
    ]  # fmt: skip
    assert [set(line.get_ydata()) for line in by_step.get_lines()[::2]] == [{0.2}, {0.6}]
    assert _legend(_axes(figures["losses"], "grad norm")) == ["sync", "async"]
    timings = figures["timings"]
    assert [ax.get_title() for ax in timings.axes] == ["sync", "async"]
    assert [_legend(ax) for ax in timings.axes] == [
        ["rollout", "train", "sync", "total"], ["rollout", "train", "total"],
    ]  # fmt: skip


def test_main_compares_runs_into_out(tmp_path, capsys, monkeypatch):
    drawn = []

    def spy(runs):
        drawn.extend(run.name for run in runs)
        return build_figures(runs)

    monkeypatch.setattr(plot, "build_figures", spy)
    rows = [{"step": step, "time": T0 + step, "raw_reward": 0.5} for step in (1, 2)]
    runs = [_write_run(tmp_path / name / "arith", rows) for name in ("a", "b", "c")]
    out = tmp_path / "cmp"
    argv = [str(runs[0]), "--compare", str(runs[1]), "--compare", str(runs[2]), "--out", str(out)]
    assert main([*argv, "--dpi", "40"]) == 0
    # Three directories named arith: the paths as given tell the runs apart.
    assert drawn == [str(run) for run in runs]
    assert capsys.readouterr().out.split() == [str(out / "reward.png")]
    assert (out / "reward.png").read_bytes().startswith(PNG_MAGIC)
    assert not (runs[0] / "plots").exists()


def test_missing_and_non_numeric_metrics_are_skipped(tmp_path):
    rows = [
        {"step": 1, "time": T0, "raw_reward": 0.5, "loss": "n/a", "group_ids": ["a"]},
        {"step": 2, "time": T0 + 1, "raw_reward": None, "loss": True, "grad_norm": float("nan")},
        {"step": 3, "time": T0 + 2, "raw_reward": 0.7, "response_len_mean": [3, 4]},
    ]
    run = _write_run(tmp_path / "sparse", rows)
    figures = build_figures([load_run(run)])
    assert list(figures) == ["reward"]  # no loss, timing or throughput number anywhere
    line = _axes(figures["reward"], "by iteration").get_lines()
    assert [list(line[0].get_xdata()), len(line)] == [[1, 3], 1]


def test_a_run_without_metrics_says_which_file_is_missing(tmp_path):
    missing = re.escape(str(tmp_path / "nowhere" / "metrics.jsonl"))
    with pytest.raises(MillstreamError, match=f"^{missing} not found"):
        main([str(tmp_path / "nowhere")])


def test_an_empty_metrics_file_is_an_error(tmp_path):
    run = _write_run(tmp_path / "fresh", [])
    path = re.escape(str(run / "metrics.jsonl"))
    with pytest.raises(MillstreamError, match=f"^{path} is empty"):
        main([str(run)])


@pytest.mark.parametrize(
    ("bad_line", "why"), [("{not json", "not JSON"), ('["step", 3]', "not a metrics row")]
)
def test_a_malformed_line_is_named_by_file_and_number(tmp_path, bad_line, why):
    run = _write_run(tmp_path / "broken", [_row(1, 0.5), _row(2, 0.5)])
    with (run / "metrics.jsonl").open("a") as f:
        f.write(bad_line + "\n" + json.dumps(_row(4, 0.5)))  # the last line is fine
    path = re.escape(str(run / "metrics.jsonl"))
    with pytest.raises(MillstreamError, match=f"^{path}:3: {why}"):
        load_run(run)


def test_a_last_line_being_written_is_left_for_later(tmp_path):
    run = _write_run(tmp_path / "live", [_row(1, 0.5), _row(2, 0.6)])
    metrics = run / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write(json.dumps(_row(3, 0.7))[:40])  # no newline yet
    assert [row["step"] for row in load_run(run).rows] == [1, 2]
    metrics.write_text(metrics.read_text()[:-40] + json.dumps(_row(3, 0.7)))
    assert [row["step"] for row in load_run(run).rows] == [1, 2, 3]
    metrics.write_text(metrics.read_text() + '\n{"step": 4,\n')  # its newline came: broken
    with pytest.raises(MillstreamError, match=r"metrics\.jsonl:4: not JSON"):
        load_run(run)


def test_nothing_to_draw_is_an_error(tmp_path):
    run = _write_run(tmp_path / "bare", [{"step": 1, "time": T0, "group_ids": []}])
    path = re.escape(str(run / "metrics.jsonl"))
    with pytest.raises(MillstreamError, match=f"^nothing to plot: .* in {path}$"):
        main([str(run)])


def test_cli_prints_the_error_on_one_line(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("millstream plot: error: ") and err.count("\n") == 1
    assert str(tmp_path / "nowhere" / "metrics.jsonl") in err
