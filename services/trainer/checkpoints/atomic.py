"""Whole or absent: how a checkpoint dir gets its name (checkpoint.py's `iter_N/`, convert.py's
`release/` and Hugging Face dirs) and what `recover` does with the leftovers of a killed writer.

A writer holds an flock on `NAME.saving-<holder>.lock`, then fills the temp dir
`NAME.saving-<holder>` beside NAME (<holder>: host, pid and a random part, so two writers of
one NAME, e.g. two trainers of one run, never share a temp dir). Once it is written, the
caller's `before_commit` may still veto it (the trainer's lease: the temp dir is removed and
its error propagates); then the temp dir is renamed to NAME. A NAME already there (the same
iteration saved again) is renamed aside first, to `NAME.replaced-<holder>`, and removed only
once the new one is in place. A tracker file (latest_checkpointed_iteration.txt) is written
after that, to a temp file of its own and renamed over the old one (`write_text`).

So NAME is never half-written, and a SIGKILL at any instant leaves at most: a temp dir (no
reader looks at it: the tracker names NAME only), an aside copy of the NAME that was being
replaced (NAME missing when the kill fell between the two renames), a lock or tracker temp
file. `recover`, at every trainer start (main.py, on --save and --load, before preflight
reads them), puts such an aside copy back and removes the rest, but never a temp dir whose
writer still holds its lock: the kernel drops an flock when its process dies, SIGKILL
included, so a held lock is a live writer (the other trainer of the run, another rank; or a
process the writer forked while saving, which shares its lock while it lives: that temp dir
waits for a later start).
Everything is a rename that happens whole or not at all; when two processes race for one
name, the loser's rename fails and it tries again. A rename is only as durable as what it
names: every file and dir of the temp dir is flushed to disk (fsync) before it becomes NAME, and
the parent dir after, so that a machine that loses power right after a save (its tracker on
disk, naming NAME) never comes back with NAME's files empty or short.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from millstream.common.errors import MillstreamError

SAVING = ".saving-"  # NAME.saving-<holder>: a writer's temp dir (or the tracker's temp file)
REPLACED = ".replaced-"  # NAME.replaced-<holder>: the NAME a commit moved aside
LOCK = ".lock"  # NAME.saving-<holder>.lock: flock'ed by the writer while the temp dir exists
# What versions before holders left: one temp name per iteration, shared by every writer.
LEGACY_TMP = re.compile(r"(iter_\d+|latest_checkpointed_iteration\.txt)\.tmp")
# A temp file or a lone lock file younger than this may be a live writer's (no lock says so).
GRACE_S = 60.0
RETRIES = 10  # renames lost to other writers of the same NAME before giving up


def holder() -> str:
    """This writer's part of a temp name: host and pid say whose it is, the random part keeps
    it unique (a restarted container runs its trainer under the same pid at once)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def write_dir(
    final: str | Path,
    fill: Callable[[Path], None],
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """`fill(tmp)` writes the dir's contents into a temp dir of this writer's; then
    `before_commit()`, then the rename to `final` (an existing `final` moved aside, removed
    once the new one is there). Anything raised, by `fill` or `before_commit` included, removes
    the temp dir, leaves `final` as it was and propagates."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}{SAVING}{holder()}")
    lock_path = tmp.with_name(tmp.name + LOCK)
    with open(lock_path, "w") as lock:  # locked before the temp dir exists: see `recover`
        _lock(lock)
        try:
            tmp.mkdir()
            fill(tmp)
            _fsync_tree(tmp)
            if before_commit is not None:
                before_commit()
            _rename_into_place(tmp, final)
            _fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            lock_path.unlink(missing_ok=True)
    return final


def write_text(path: str | Path, text: str) -> None:
    """`path` holds `text`, or what it held before: a temp file of this writer's, flushed to
    disk, renamed over it (a tracker must not name an iteration on its own after a crash)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}{SAVING}{holder()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_tree(root: Path) -> None:
    """Every file under `root`, then every dir, on disk (the module docstring)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    """A dir's entries on disk; a file system that cannot sync a dir (EINVAL on some network
    and FUSE mounts) is left to its own guarantees."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _rename_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`, moving a `final` already there aside first and removing it
    once `tmp` is in place. Another writer of `final` may put its own there between the two
    renames (ours then fails: a dir over a non-empty dir): it is moved aside in turn."""
    asides: list[Path] = []
    try:
        for _ in range(RETRIES):
            if final.exists():
                aside = final.with_name(f"{final.name}{REPLACED}{holder()}")
                with contextlib.suppress(FileNotFoundError):  # moved by another writer
                    os.rename(final, aside)
                    asides.append(aside)
            try:
                os.rename(tmp, final)
                break
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        else:
            raise MillstreamError(f"{final}: other writers kept replacing it ({RETRIES} tries)")
    except BaseException:
        if asides and not final.exists():
            with contextlib.suppress(OSError):
                os.rename(asides.pop(), final)
        raise
    for aside in asides:
        shutil.rmtree(aside, ignore_errors=True)


def _lock(f: IO[str]) -> None:
    """The writer's flock; a file system without locks saves unlocked (`recover` then
    leaves the temp dir alone: it cannot tell a live writer from a dead one)."""
    with contextlib.suppress(OSError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _writer_gone(lock_path: Path) -> bool:
    """True when no live process writes under this lock: the lock file is gone (a temp dir
    of a version before locks) or its flock is free (its writer died)."""
    try:
        f = open(lock_path)  # noqa: SIM115 (held for the test below; flock needs no write)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live writer; or no locks here, so no telling
            return False
        return True


def _age(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except OSError:
        return 0.0


def recover(root: str | Path | None) -> list[str]:
    """Put back or remove what killed writers left in `root`; returns a line per leftover
    handled, for the log. Safe beside live writers (see the module docstring); a step that
    fails (a read-only --load, another process first) is left for the next start."""
    if not root or not Path(root).is_dir():
        return []
    said: list[str] = []
    for path in sorted(Path(root).iterdir()):
        name = path.name
        if REPLACED in name:
            final = path.with_name(name.split(REPLACED, 1)[0])
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
                said.append(f"removed {path} (the copy a save replaced: {final.name} is whole)")
                continue
            with contextlib.suppress(OSError):
                os.rename(path, final)
                said.append(f"put {final} back from {path.name} (a save killed while replacing it)")
        elif name.endswith(LOCK) and SAVING in name:
            # Its temp dir gone: a kill after the rename into place, before the unlink.
            alone = not path.with_name(name[: -len(LOCK)]).exists()
            if alone and _age(path) > GRACE_S and _writer_gone(path):
                path.unlink(missing_ok=True)
        elif SAVING in name or LEGACY_TMP.fullmatch(name):
            if not path.is_dir():
                if _age(path) > GRACE_S:  # a tracker's temp file
                    path.unlink(missing_ok=True)
            elif _writer_gone(lock := path.with_name(name + LOCK)):
                shutil.rmtree(path, ignore_errors=True)
                lock.unlink(missing_ok=True)
                said.append(f"removed {path} (a save killed mid-write; never loaded)")
    return said
