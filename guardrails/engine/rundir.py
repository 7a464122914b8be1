"""The run directory at the guard's start: checked, then held by one run at a time.

**Checked** (:func:`check`, every rank): a ``run_dir`` that cannot work from the start
(a regular file, a path below one, a directory this user may not write into) is a
typo or a setup mistake, so it is a :class:`~guardrails.LaunchError` naming the path
and why, before step one. Before, the run trained for its whole length with warnings
only and every metric, event and checkpoint was dropped. What the *disk* does
(full, a file size limit, read-only) is left to the degrading writes as before
(``util/storage.py``): it can heal, and a run on it still trains.

**Held** (:class:`RunLock`, rank 0 of the job only): two jobs on one ``run_dir`` (a
re-launch while the old job still runs, two array jobs with one config) shared its
checkpoints' temp directories and retention, and the second died at its first save
blaming free space. Rank 0 takes an advisory ``flock`` on ``run_dir/run.lock`` for the
guard's life and writes who holds it (pid, host, since when, the command) into it; the
kernel releases it when the process dies, however it dies, so a SIGKILLed run leaves
no stale lock. The other ranks of the same job share the directory and take nothing:
they hear rank 0's refusal through the side store and raise the same error. A
filesystem without ``flock`` (some NFS mounts) makes it a warning, never a refusal.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from guardrails._errors import LaunchError
from guardrails.engine import last_failure
from guardrails.util import files
from guardrails.util.checks import path_like

logger = logging.getLogger("guardrails.guard")

#: The lock file's name inside ``run_dir``.
LOCK_NAME = "run.lock"

# Errors that say the path cannot be a run directory at all (its shape or its
# permissions): refused at start. ENOSPC / EFBIG / EROFS / EDQUOT are the disk's state,
# degraded around as mid-run.
_SETUP_ERRNOS = {errno.ENOTDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG}
# flock not supported by the filesystem (NFS without lockd, some FUSE mounts).
_NO_FLOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


def check_arg(run_dir: Any) -> None:
    """``guard(run_dir=...)``'s type and value, where it is passed."""
    path_like("guard(run_dir=...)", run_dir)
    if not os.fspath(run_dir):
        raise ValueError(
            "guard(run_dir='') is empty: metrics, events and checkpoints would go into the "
            "current directory, mixed with whatever is there. Pass a directory such as "
            "run_dir='runs/exp1', or leave it out for runs/<script name>."
        )


def check(run_dir: Path, rank: int) -> None:
    """Make ``run_dir`` (``mkdir -p``) and prove this process can create a file in it;
    a :class:`LaunchError` (``check="run_dir"``) when its shape or permissions make
    that impossible. A disk that is full or read-only passes: the writes degrade.
    Then the failure the run before recorded there, raised again when a restart cannot
    fix it (``engine/last_failure.py``)."""
    try:
        if os.path.lexists(run_dir) and not run_dir.is_dir():
            raise NotADirectoryError(errno.EEXIST, "exists and is not a directory")
        files.make_dirs(run_dir)
        probe = run_dir / f".write-probe-{os.getpid()}-{rank}"
        os.close(files.open_new(probe))
        os.unlink(probe)
    except OSError as err:
        code = err.errno
        if isinstance(err, NotADirectoryError) and code is None:
            code = errno.ENOTDIR
        if code not in _SETUP_ERRNOS:
            return  # the disk's state: the writes degrade and warn (util/storage.py)
        raise LaunchError(
            f"run_dir {str(run_dir)!r} cannot be used: {_why(run_dir, code)}. Nothing was "
            "trained: every metric, event and checkpoint of this run would be lost",
            rank=rank,
            check="run_dir",
            hint="pass guard(run_dir=...) a directory this user can create files in",
        ) from err
    # A torchrun restart after a failure no restart can fix ends here, before training.
    last_failure.check_at_start(run_dir, rank)


def _why(run_dir: Path, code: int | None) -> str:
    """The reason, naming the path that is in the way."""
    if code in (errno.ENOTDIR, errno.EEXIST):
        for p in (run_dir, *run_dir.parents):
            if os.path.lexists(p) and not p.is_dir():
                if p == run_dir:
                    return "it exists and is a file, not a directory"
                return f"{str(p)!r} above it is a file, not a directory"
        return "a part of the path is not a directory"
    if code in (errno.EACCES, errno.EPERM):
        existing = next((p for p in (run_dir, *run_dir.parents) if p.exists()), run_dir)
        mode = ""
        with contextlib.suppress(OSError):
            mode = f" (mode {oct(existing.stat().st_mode & 0o777)[2:]})"
        return f"this user may not create files in {str(existing)!r}{mode}"
    return os.strerror(code) if code else "it is not a usable directory"


class RunLock:
    """The advisory lock that keeps a second run out of ``run_dir`` (see the module
    docstring). :meth:`acquire` returns ``None`` when held (or when the filesystem
    cannot lock: a warning), else the refusal message."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, run_id: str) -> str | None:
        try:
            # Not O_TRUNC: the holder's content must survive a refused open.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, files.FILE_MODE)
        except OSError as err:
            logger.warning(
                "guardrails: could not open %s to keep other runs out of this run_dir (%s); "
                "training goes on without that protection",
                self.path,
                err,
            )
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = _read_holder(fd)
                os.close(fd)
                return _refusal(self.path.parent, holder)
            os.close(fd)
            if err.errno in _NO_FLOCK_ERRNOS:
                logger.warning(
                    "guardrails: the filesystem of %s does not support file locks (%s): "
                    "a second run started on this run_dir would not be refused",
                    self.path.parent,
                    err,
                )
                return None
            raise
        self._fd = fd
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "run": run_id,
            "command": " ".join(sys.argv)[:500],
        }
        with contextlib.suppress(OSError):  # a full disk: held all the same, unnamed
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        return None

    def release(self) -> None:
        """Unlock (the file stays: removing it would let a third run lock a new file
        while a second still waits on the old one)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        holder = json.loads(text)
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _refusal(run_dir: Path, holder: dict[str, Any]) -> str:
    if holder.get("pid"):
        who = (
            f"process {holder['pid']} on host {holder.get('host', '?')}, since "
            f"{holder.get('since', '?')}"
        )
        if holder.get("command"):
            who += f" (command: {holder['command']})"
    else:
        who = "another process (it has not written its pid yet)"
    return (
        f"run_dir {str(run_dir)!r} is in use by another run: {who}. Two runs in one "
        "run_dir would delete each other's checkpoints and mix their metrics"
    )


REFUSAL_HINT = (
    "pass this run another run_dir, or stop the other job first (its lock is released "
    "as soon as its process ends, however it ends)"
)


def refused(message: str, rank: int) -> LaunchError:
    return LaunchError(message, rank=rank, check="run_dir_in_use", hint=REFUSAL_HINT)
