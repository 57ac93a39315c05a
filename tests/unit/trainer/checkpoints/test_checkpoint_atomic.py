"""A checkpoint is whole or absent (trainer/checkpoints/atomic.py): a process killed while it
replaces an iteration loses nothing, a `before_commit` that raises (the trainer's lease lost)
leaves the latest as it was, two writers of one iteration do not mix their files, and what a
killed save leaves is put back or removed at the next start, but never a live writer's. The
trainer killed mid-save for real: tests/e2e/test_checkpoint_kill.py."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from millstream.trainer.checkpoints import atomic, checkpoint, megatron_ckpt


class Backend:
    """What checkpoint.save asks of a backend: its files, here two named after `tag`, written
    with `between()` called in between (a slow save that others can overlap)."""

    def __init__(self, tag: str, between=lambda: None):
        self.tag, self.between = tag, between

    def save(self, directory: Path, save_optimizer: bool = True) -> None:
        (directory / "model.txt").write_text(self.tag)
        self.between()
        (directory / "optimizer.txt").write_text(self.tag)


def _whole(directory: Path) -> str:
    """The tag of a whole checkpoint dir (each file by the same writer), else an error."""
    tags = {(directory / n).read_text() for n in ("model.txt", "optimizer.txt")}
    state = json.loads((directory / checkpoint.STATE).read_text())
    assert len(tags) == 1 and tags == {state["tag"]}, (directory, tags, state["tag"])
    return state["tag"]


def _save(root: Path, iteration: int, tag: str, between=lambda: None, **kw) -> Path:
    backend = Backend(tag, between)
    return checkpoint.save(root, iteration, backend, {"tag": tag}, save_optimizer=True, **kw)


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# A child that saves iteration 3, then saves it again and is SIGKILLed at the rename of the new
# copy into place: after the old iter_0000003/ was moved aside (or, before, deleted).
KILLED_WHILE_REPLACING = """
import os, signal, sys
from pathlib import Path
from tests.unit.trainer.checkpoints.test_checkpoint_atomic import _save
root = Path(sys.argv[1])
_save(root, 3, "first")
real_rename, real_replace = os.rename, os.replace
def rename(src, dst, real):
    if Path(dst).name == "iter_0000003" and Path(src).name != "iter_0000003":
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)
os.rename = lambda s, d: rename(s, d, real_rename)
os.replace = lambda s, d: rename(s, d, real_replace)
_save(root, 3, "second")
"""


def test_a_save_killed_while_replacing_an_iteration_loses_nothing(tmp_path):
    """Saving an iteration that is there already (the latest, here) and killed between taking
    the old copy away and renaming the new one in: the old copy is kept aside, whole, and put
    back at the next start (`recover`). It used to be deleted first (rmtree, then rename): the
    latest named a checkpoint that was gone, and the next start failed on it."""
    root = tmp_path / "ckpt"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_REPLACING, str(root)],
        cwd=Path(__file__).resolve().parents[4], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    kept = [p for p in root.iterdir() if p.is_dir() and (p / checkpoint.STATE).exists()]
    assert [_whole(p) for p in kept if "saving" not in p.name] == ["first"], _entries(root)

    said = atomic.recover(root)
    assert any("put" in line and "back" in line for line in said), said
    assert checkpoint.latest_iteration(root) == 3
    assert _whole(checkpoint.iter_dir(root, 3)) == "first"
    assert checkpoint.load_state(root, 3)["tag"] == "first"
    assert _entries(root) == ["iter_0000003", checkpoint.LATEST]  # the killed save's: removed


class LeaseLost(Exception):
    pass


def test_a_before_commit_that_raises_leaves_the_latest_and_no_temp_dir(tmp_path):
    """The trainer's lease lost at the last moment: nothing is renamed into place or made the
    latest, the temp dir is gone, and the hook's error is the caller's. The hook runs once
    everything is written (the temp dir holds the whole checkpoint then)."""
    root = tmp_path / "ckpt"
    _save(root, 2, "kept")
    seen: list[list[str]] = []

    def lost() -> None:
        (tmp,) = [p for p in root.iterdir() if p.is_dir() and atomic.SAVING in p.name]
        seen.append(sorted(p.name for p in tmp.iterdir()))
        raise LeaseLost("run held by trainer b")

    for iteration in (4, 2):  # a new iteration, and the latest saved again
        with pytest.raises(LeaseLost, match="trainer b"):
            _save(root, iteration, "fenced", before_commit=lost)
        assert checkpoint.latest_iteration(root) == 2
        assert _whole(checkpoint.iter_dir(root, 2)) == "kept"
        assert _entries(root) == ["iter_0000002", checkpoint.LATEST]
    assert seen == [["model.txt", "optimizer.txt", checkpoint.STATE]] * 2

    calls = []
    _save(root, 4, "held", before_commit=lambda: calls.append(1))
    assert calls == [1] and checkpoint.latest_iteration(root) == 4


def test_two_writers_of_one_iteration_do_not_mix_their_files(tmp_path):
    """Two trainers of one run save the same iteration at once: each writes a temp dir of its
    own, and the one in place at the end is one writer's, whole. With one temp name for both
    (`iter_N.tmp`), the second deleted the first one's files as it wrote them."""
    root = tmp_path / "ckpt"
    both_writing = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def write(tag: str) -> None:
        try:
            _save(root, 5, tag, between=both_writing.wait)
        except BaseException as err:  # the test reports it
            errors.append(err)
            both_writing.abort()

    threads = [threading.Thread(target=write, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert _whole(checkpoint.iter_dir(root, 5)) in ("a", "b")
    assert _entries(root) == ["iter_0000005", checkpoint.LATEST]


def test_a_start_removes_a_dead_writers_temp_dir_but_not_a_live_ones(tmp_path):
    """`recover` removes a temp dir once no process holds its lock (the kernel drops it when
    the writer dies), one an older version left (iter_N.tmp), a lone lock file and old tracker
    temp files; it keeps a live writer's temp dir (the other trainer's, saving now) and a
    young tracker temp file (a writer between its write and its rename)."""
    root = tmp_path / "ckpt"
    _save(root, 1, "one")
    live = root / f"iter_0000002{atomic.SAVING}host-1-aa"
    dead = root / f"iter_0000003{atomic.SAVING}host-2-bb"
    legacy = root / "iter_0000004.tmp"
    for d in (live, dead, legacy):
        d.mkdir()
        (d / "model.txt").write_text("part")
    (root / f"{dead.name}{atomic.LOCK}").touch()  # its writer died: nobody holds it
    lone = root / f"iter_0000001{atomic.SAVING}host-3-cc{atomic.LOCK}"
    old_tracker = root / f"{checkpoint.LATEST}{atomic.SAVING}host-4-dd"
    young_tracker = root / f"{checkpoint.LATEST}{atomic.SAVING}host-5-ee"
    for f in (lone, old_tracker, young_tracker):
        f.touch()
    hour_ago = time.time() - 3600
    for f in (lone, old_tracker):
        os.utime(f, (hour_ago, hour_ago))
    with open(root / f"{live.name}{atomic.LOCK}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the live writer holds it
        said = atomic.recover(root)
        assert live.is_dir() and not dead.exists() and not legacy.exists()
        assert not lone.exists() and not old_tracker.exists() and young_tracker.exists()
        assert len(said) == 2, said
    atomic.recover(root)  # the writer gone now
    assert not live.exists() and not (root / f"{live.name}{atomic.LOCK}").exists()
    assert checkpoint.latest_iteration(root) == 1 and _whole(root / "iter_0000001") == "one"


def test_a_moved_aside_copy_is_removed_when_its_iteration_is_whole_again(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1, "new")
    aside = root / f"iter_0000001{atomic.REPLACED}host-1-aa"
    aside.mkdir()
    assert atomic.recover(root) and not aside.exists()
    assert _whole(root / "iter_0000001") == "new"


def test_a_megatron_root_without_a_tracker_never_names_a_temp_dir(tmp_path):
    """With no tracker, megatron_ckpt takes the newest iter_*/: a killed save's temp dir sorts
    after its iteration's own and used to be taken for it."""
    for name in ("iter_0000002", f"iter_0000009{atomic.SAVING}host-1-aa", "iter_0000009.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").touch()
    assert megatron_ckpt.checkpoint_dir(tmp_path) == tmp_path / "iter_0000002"
    assert "iter_0000002/ holds" in (megatron_ckpt.describe(tmp_path) or "")


def test_a_tracker_is_never_half_written(tmp_path):
    """write_text: the old text or the new one, and no temp file left behind."""
    path = tmp_path / checkpoint.LATEST
    atomic.write_text(path, "3")
    atomic.write_text(path, "12")
    assert path.read_text() == "12" and _entries(tmp_path) == [checkpoint.LATEST]


def test_a_checkpoint_is_on_disk_before_its_name_and_its_tracker(tmp_path, monkeypatch):
    """Each file and dir of the new iteration fsynced before the rename makes it the iteration,
    the parent dir after it, and the tracker (naming it) after that: a power loss never leaves
    a tracker naming a dir whose files the page cache lost."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    final = _save(tmp_path, 3, "first")
    renamed = events.index(("rename", str(final)))
    synced = [Path(path) for kind, path in events[:renamed] if kind == "fsync"]
    (temp,) = {p for p in synced if p.name.startswith(final.name + atomic.SAVING)}
    inside = {p.relative_to(temp) for p in synced if p.is_relative_to(temp) and p != temp}
    assert inside == {p.relative_to(final) for p in final.rglob("*")}
    after = [Path(path) for kind, path in events[renamed:] if kind == "fsync"]
    assert after[0] == tmp_path  # the rename itself
    assert after[-1] == tmp_path and any(p.name.startswith(checkpoint.LATEST) for p in after)
