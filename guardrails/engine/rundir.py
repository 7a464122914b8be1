"""The run directory at the guard's start: checked, then held by one run at a time.

**Checked** (:func:`check`, every rank): a ``run_dir`` that cannot work from the start
(a regular file, a path below one, a directory this user may not write into) is a
typo or a setup mistake, so it is a :class:`~guardrails.LaunchError` naming the path
and why, before step one. Before, the run trained for its whole length with warnings
only and every metric, event and checkpoint was dropped. What the *disk* does
(full, a file size limit, read-only) is left to the degrading writes as before
(``util/storage.py``): it can heal, and a run on it still trains. A run_dir whose own
files (``run.lock``, the events logs) are symbolic links is refused
(``check="run_dir_link"``): written through, a link to ``/etc/passwd`` truncated it
when run as root (issue 52). Nothing guardrails opens there follows a link
(``O_NOFOLLOW``), and what it creates it creates with ``O_EXCL``.

**Held** (:class:`RunLock`, rank 0 of the job only): two jobs on one ``run_dir`` (a
re-launch while the old job still runs, two array jobs with one config) shared its
checkpoints' temp directories and retention, and the second died at its first save
blaming free space. Rank 0 takes an advisory ``flock`` on ``run_dir/run.lock`` for the
guard's life and writes who holds it (pid, host, since when, the command) into it; the
kernel releases it when the process dies, however it dies, so a SIGKILLed run leaves
no stale lock. The other ranks of the same job share the directory and take nothing:
they hear rank 0's refusal through the side store and raise the same error.

* A lock file that cannot be opened (a directory named ``run.lock``, another user's
  file) is a refusal (``check="run_dir_lock"``): as a warning, two jobs trained at once
  and the second resumed the first's checkpoint. Only a filesystem without ``flock``
  (some NFS mounts), or a full or read-only disk, is a warning, naming what is then
  unprotected.
* A child forked without exec (a DataLoader worker, a user's subprocess) closes its
  copy of the lock at fork (``os.register_at_fork``): it kept the lock after its
  parent was SIGKILLed, and the relaunch was refused naming a dead process. A lock
  whose recorded holder is dead on this host (a child forked where Python's fork hooks
  do not run still holds it) is taken over, with a warning.
* The same class locks a checkpoint directory outside the run_dir (``knob``): two runs
  sharing one ``checkpoint={"directory": ...}`` broke each other's saves.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from guardrails._errors import LaunchError
from guardrails.engine import last_failure
from guardrails.metrics import events
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
# The disk's state, not the lock file's: a lock that cannot be created there is a warning.
_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG}


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
    _refuse_links(run_dir, rank)
    # A torchrun restart after a failure no restart can fix ends here, before training.
    last_failure.check_at_start(run_dir, rank)


def _refuse_links(run_dir: Path, rank: int) -> None:
    """A run_dir whose own files (the lock, the events logs) are symbolic links is
    refused: written through, a link to ``/etc/passwd`` truncated it (issue 52), and
    guardrails opens nothing in a run_dir through a link (``O_NOFOLLOW``)."""
    own = [run_dir / LOCK_NAME, *sorted(run_dir.glob(events.EVENTS_GLOB))]
    links = [p for p in own if p.is_symlink()]
    if not links:
        return
    listed = ", ".join(f"{str(p)!r} -> {os.readlink(p)!r}" for p in links)
    raise LaunchError(
        f"run_dir {str(run_dir)!r} holds symbolic links where guardrails writes its own "
        f"files: {listed}. guardrails follows no link in a run_dir: written through, a "
        "link overwrites whatever it points to",
        rank=rank,
        check="run_dir_link",
        hint="remove the links (rm " + " ".join(str(p) for p in links) + ") or pass "
        "another run_dir",
    )


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


def inside(directory: Path, run_dir: Path) -> bool:
    """Whether ``directory`` is ``run_dir`` or below it (``run_dir``'s lock covers it)."""
    return Path(os.path.realpath(directory)).is_relative_to(os.path.realpath(run_dir))


def prepare(directory: Path) -> bool:
    """``mkdir -p directory`` for its lock; ``False`` when it cannot be made (its
    writer's own errors say why, at its first write)."""
    try:
        files.make_dirs(directory)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Refusal:
    """Why rank 0 will not start in a directory: the :class:`LaunchError` every rank
    raises, as text for the side store (``store.publish_refusal``)."""

    message: str
    check: str
    hint: str

    def encode(self) -> str:
        return json.dumps({"message": self.message, "check": self.check, "hint": self.hint})

    @classmethod
    def decode(cls, text: str) -> Refusal:
        fields = json.loads(text)
        return cls(fields["message"], fields["check"], fields["hint"])

    def error(self, rank: int) -> LaunchError:
        return LaunchError(self.message, rank=rank, check=self.check, hint=self.hint)


class RunLock:
    """The advisory lock that keeps a second run out of a directory (see the module
    docstring): ``run_dir/run.lock``, or ``run.lock`` in a checkpoint directory outside
    the run_dir. :meth:`acquire` returns ``None`` when held (or when the filesystem
    cannot lock: a warning saying what is unprotected), else the :class:`Refusal`."""

    #: Locks this process holds: a child forked without exec closes them (issue 52:
    #: a DataLoader worker kept the lock after its parent was SIGKILLed, and the
    #: relaunch was refused naming a dead process).
    _held: ClassVar[weakref.WeakSet[RunLock]] = weakref.WeakSet()

    def __init__(self, directory: Path, *, knob: str = "run_dir") -> None:
        self.path = directory / LOCK_NAME
        self.knob = knob  # the user's name for the directory, in messages
        self._fd: int | None = None

    def acquire(self, run_id: str) -> Refusal | None:
        for _ in range(2):  # once more when a dead holder's file was replaced meanwhile
            opened = self._open()
            if not isinstance(opened, int):
                return opened
            fd = opened
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    if err.errno in _NO_FLOCK_ERRNOS:
                        self._unprotected(err)
                        return None
                    raise
                holder = _read_holder(fd)
                if not _dead_here(holder):
                    os.close(fd)
                    return _in_use(self.path.parent, holder, self.knob)
                replaced = self._replace_stale(fd, holder)
                os.close(fd)
                if replaced is None:
                    continue
                fd = replaced
            self._hold(fd, run_id)
            return None
        return _in_use(self.path.parent, {}, self.knob)

    def release(self) -> None:
        """Unlock (the file stays: removing it would let a third run lock a new file
        while a second still waits on the old one)."""
        fd, self._fd = self._fd, None
        RunLock._held.discard(self)
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _open(self) -> int | Refusal | None:
        """The lock file, never through a link: created with ``O_EXCL``, else the
        existing regular file opened. A link, a directory, another user's file: the
        :class:`Refusal`; a full or read-only disk: a warning and ``None``."""
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            try:  # Not O_TRUNC: the holder's content must survive a refused open.
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, files.FILE_MODE)
            except FileExistsError:
                fd = os.open(self.path, flags)
        except OSError as err:
            if err.errno in _DISK_ERRNOS:
                self._unprotected(err)
                return None
            return self._unusable(err)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return self._unusable(OSError(errno.EINVAL, "not a regular file"))
        return fd

    def _unusable(self, err: OSError) -> Refusal:
        where = str(self.path)
        if err.errno == errno.ELOOP or os.path.islink(self.path):
            return Refusal(
                f"{where} is a symbolic link (to {os.readlink(self.path)!r}): guardrails "
                f"follows no link in a {self.knob}, since the lock written through it would "
                "overwrite whatever it points to",
                "run_dir_link",
                f"remove the link ({where}) or pass another {self.knob}",
            )
        why = "it is a directory" if err.errno == errno.EISDIR else (err.strerror or str(err))
        return Refusal(
            f"{where} cannot be opened ({why}): it is the lock that keeps a second job out "
            f"of this {self.knob}; without it two jobs would train at once, sharing and "
            "deleting each other's checkpoints",
            "run_dir_lock",
            f"remove or rename {where} (it must be a regular file this user can write), "
            f"or pass another {self.knob}",
        )

    def _unprotected(self, err: OSError) -> None:
        logger.warning(
            "guardrails: %s cannot be locked (%s): nothing keeps a second job out of %s; "
            "two jobs started on it would share and delete each other's checkpoints and "
            "mix their events. Training goes on",
            self.path,
            err,
            self.path.parent,
        )

    def _replace_stale(self, old_fd: int, holder: dict[str, Any]) -> int | None:
        """The lock of a holder that died on this host, still held by a process it
        forked: a new lock file renamed over the old one, its fd; ``None`` when another
        run replaced it first. Under a lock on the directory, so two new runs cannot
        both replace it."""
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):  # no flock: the check below still helps
                fcntl.flock(dir_fd, fcntl.LOCK_EX)
            with contextlib.suppress(OSError):
                if os.stat(self.path, follow_symlinks=False).st_ino != os.fstat(old_fd).st_ino:
                    return None
            fresh = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fresh)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(fresh, flags, files.FILE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(fresh, self.path)
        finally:
            os.close(dir_fd)  # (closing it releases the directory's lock)
        logger.warning(
            "guardrails: %s was locked by process %s on this host, which is dead; a process "
            "it forked still holds the file open. The lock was taken over",
            self.path,
            holder.get("pid"),
        )
        return fd

    def _hold(self, fd: int, run_id: str) -> None:
        self._fd = fd
        RunLock._held.add(self)
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "run": run_id,
            "command": " ".join(sys.argv)[:500],
            "pid_namespace": _pid_namespace(),
        }
        with contextlib.suppress(OSError):  # a full disk: held all the same, unnamed
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)

    @classmethod
    def _close_in_child(cls) -> None:
        """After ``fork()``, in the child: close the inherited lock fds (only closed:
        an unlock would release the parent's lock too, it is one open file)."""
        for lock in list(cls._held):
            fd, lock._fd = lock._fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        cls._held.clear()


os.register_at_fork(after_in_child=RunLock._close_in_child)


def _pid_namespace() -> int | None:
    """This process's pid namespace (Linux): two containers with one host name count
    their pids apart, so a pid is only looked up in the namespace that recorded it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _dead_here(holder: dict[str, Any]) -> bool:
    """Whether the recorded holder is a process of this host (and pid namespace) that
    no longer exists."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0 or holder.get("host") != socket.gethostname():
        return False
    if holder.get("pid_namespace") != _pid_namespace():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's live process
        return False
    return False


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        holder = json.loads(text)
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _in_use(directory: Path, holder: dict[str, Any], knob: str) -> Refusal:
    if holder.get("pid"):
        who = (
            f"process {holder['pid']} on host {holder.get('host', '?')}, since "
            f"{holder.get('since', '?')}"
        )
        if holder.get("command"):
            who += f" (command: {holder['command']})"
    else:
        who = "another process (it has not written its pid yet)"
    return Refusal(
        f"{knob} {str(directory)!r} is in use by another run: {who}. Two runs in one "
        f"{knob} would delete each other's checkpoints and mix their metrics",
        "run_dir_in_use",
        f"pass this run another {knob}, or stop the other job first (its lock is released "
        "as soon as its process ends, however it ends)",
    )
