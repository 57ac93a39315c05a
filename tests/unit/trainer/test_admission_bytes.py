"""--max-buffer-bytes' arithmetic (trainer/admission.py ByteBound): what admission lets out
besides the staleness budget, the floor of one batch in flight, and its one line per episode."""

from __future__ import annotations

from millstream.common.config import ConfigError, parse_run_config
from millstream.trainer.admission import Admission, ByteBound, prior_group_bytes

MB = 1_000_000


def admission(limit: int, held: list[tuple[int, int]], batch: int = 4, prior: int = MB):
    """An Admission whose buffer holds `held[0]` (bytes, groups); no Redis is touched."""
    bound = ByteBound(limit, prior, lambda: held[0])
    return Admission(None, "s", None, batch, 8, 1, bytes=bound), bound  # type: ignore[arg-type]


def test_bytes_hold_back_what_the_count_would_let_out(capsys):
    held = [(0, 0)]
    a, bound = admission(10 * MB, held)
    assert a.byte_room(20) == 10  # nothing out, nothing held: ten groups of ~1 MB
    said = capsys.readouterr().out
    assert "holds back for --max-buffer-bytes 10 MB: 0 groups out and 0 back count 0 B" in said
    assert "(~1 MB a group, none back yet); 10 more would fit" in said
    a.in_flight.update({f"g{i}": (0, i) for i in range(10)})
    assert a.byte_room(10) == 0  # ten out at ~1 MB each fill it
    # Six came back (3 MB in all: smaller than feared) and wait to train; four still out.
    for _ in range(6):
        bound.observe(MB // 2)
    held[0] = (3 * MB, 6)
    assert bound.per_group == MB // 2
    assert a.byte_room(10) == (10 * MB - 3 * MB - 4 * MB // 2) // (MB // 2) == 10
    assert bound.peak >= 10 * MB - MB // 2
    out = capsys.readouterr().out
    assert out.count("holds back") == 0  # one line per episode: this one let all out


def test_the_largest_recent_group_counts_for_those_still_out():
    a, bound = admission(100 * MB, [(0, 0)])
    for size in (MB, 3 * MB, 2 * MB):
        bound.observe(size)
    assert bound.per_group == 3 * MB
    a.in_flight.update({f"g{i}": (0, i) for i in range(30)})
    assert bound.counted(30) == 90 * MB
    assert a.byte_room(50) == 3


def test_never_fewer_than_one_batch_in_flight(capsys):
    a, bound = admission(MB // 10, [(0, 0)], batch=4)  # less than one group
    assert a.byte_room(8) == 4  # a batch, whatever its bytes: else nothing would train
    a.in_flight.update({f"g{i}": (0, i) for i in range(4)})
    assert a.byte_room(4) == 0
    assert capsys.readouterr().out.count("holds back") == 1
    assert bound.holds == 1


def test_without_a_bound_the_count_alone_decides():
    a = Admission(None, "s", None, 4, 8, 1)  # type: ignore[arg-type]
    assert a.byte_room(7) == 7


def test_the_prior_is_every_sample_at_its_longest_and_the_flag_is_checked():
    assert prior_group_bytes(16, 32768) == 16 * (32768 * 14 + 256)
    flags = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    cfg = parse_run_config([*flags, "--max-buffer-bytes", "5000000"], mode="async")
    assert cfg.service.max_buffer_bytes == 5 * MB
    try:
        parse_run_config([*flags, "--max-buffer-bytes", "0"], mode="async")
    except (ConfigError, SystemExit):
        pass
    else:
        raise AssertionError("--max-buffer-bytes 0 was accepted")
