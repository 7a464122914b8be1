"""Storage errors in the user's terms, and writes that degrade instead of ending a run.

A full disk, a quota, a read-only remount or a permission change does not make the
training itself wrong: only what guardrails writes beside it (events, metrics) fails.
Those writes are not worth a run: on an ``OSError`` they keep what they could not
write in memory, bounded, say so once (and again at most every
:data:`WARN_EVERY_S`), and retry at their next write. Checkpoints are the one write a
run depends on; their errors are :class:`guardrails.CheckpointError` with the fix
(:func:`fix_for`), raised by :mod:`guardrails.checkpoint`.

Imports neither torch nor numpy (the events log is plumbing every part uses).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from pathlib import Path

#: A storage problem that lasts is repeated at most this often (a disk that stays full
#: for an hour says so 6 times, not at every part or event).
WARN_EVERY_S = 600.0

#: errno -> what is wrong, said of the directory ``{where}``.
_CAUSES = {
    errno.ENOSPC: "the disk holding {where} is full",
    errno.EDQUOT: "the disk quota of the user running training is used up on {where}",
    errno.EFBIG: "a file size limit (ulimit -f, RLIMIT_FSIZE) stops writes under {where}",
    errno.EROFS: "{where} is on a read-only file system",
    errno.EACCES: "the user running training may not write in {where}",
    errno.EPERM: "the user running training may not write in {where}",
}
#: errno -> the fix.
_FIXES = {
    errno.ENOSPC: "free space on that disk",
    errno.EDQUOT: "free space or raise the quota",
    errno.EFBIG: "raise the limit (ulimit -f unlimited)",
    errno.EROFS: "remount it read-write",
    errno.EACCES: "check the permissions of {where} (chmod / chown, or run as its owner)",
    errno.EPERM: "check the permissions of {where} (chmod / chown, or run as its owner)",
}


def is_storage_error(error: BaseException) -> bool:
    """Whether ``error`` is the storage failing (an ``OSError``, or safetensors' own
    error type, which wraps the OS's for the files it writes itself)."""
    if isinstance(error, OSError):
        return True
    return type(error).__name__ == "SafetensorError"


def errno_of(error: BaseException) -> int | None:
    """The OS error number of ``error``: an ``OSError``'s, or the one safetensors puts
    in its message ("I/O error: File too large (os error 27)")."""
    code = getattr(error, "errno", None)
    if isinstance(code, int):
        return code
    found = re.search(r"os error (\d+)", str(error))
    return int(found.group(1)) if found else None


def cause_of(error: BaseException, where: str | os.PathLike[str]) -> str:
    """What is wrong with the storage at ``where``, in words, or ``""`` when the errno
    says nothing specific."""
    code = errno_of(error)
    return _CAUSES[code].format(where=where) if code in _CAUSES else ""


def fix_for(error: BaseException, where: str | os.PathLike[str], *, run_dir: bool = True) -> str:
    """The fix for ``error`` writing under ``where``: free space, the permissions, or
    another directory (``run_dir``: say it in ``guard(run_dir=...)``'s terms)."""
    code = errno_of(error)
    other = "point run_dir at another disk" if run_dir else "write to another directory"
    if code in _FIXES:
        return f"{_FIXES[code].format(where=where)}, or {other}"
    return f"check free space and permissions of {where}, or {other}"


class Trouble:
    """Rate-limited warnings for one kind of write that failed and is retried.

    :meth:`failed` at each failure: the first one warns at once; while the failures go
    on, a reminder at most every :data:`WARN_EVERY_S`. :meth:`recovered` once a write
    goes through again: one line, with how much was lost. Logged only (never as an
    event: the events log may be the very file that fails)."""

    def __init__(self, what: str, where: Path, log: logging.Logger) -> None:
        self.what = what
        self.where = where
        self.log = log
        self.failures = 0
        self._warned_at = -float("inf")

    @property
    def failing(self) -> bool:
        return self.failures > 0

    def failed(self, error: BaseException, kept: str) -> None:
        """Say that writing failed with ``error``; ``kept``: what is kept meanwhile
        and what was dropped (``"12 events kept in memory"``)."""
        self.failures += 1
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            return
        again = self.failures > 1
        self._warned_at = now
        cause = cause_of(error, self.where)
        self.log.warning(
            "guardrails: %s %s (%s%s); training goes on: %s, written when the disk "
            "takes them again (retried at each write). Fix: %s.",
            "still cannot write" if again else "could not write",
            self.what,
            f"{cause}: " if cause else "",
            error,
            kept,
            fix_for(error, self.where),
        )

    def recovered(self, lost: str) -> None:
        """Say that a write went through after failures; ``lost``: what could not be
        kept (``""``: nothing)."""
        if not self.failures:
            return
        self.log.warning(
            "guardrails: %s written again after %d failed write(s)%s",
            self.what,
            self.failures,
            f"; {lost}" if lost else "; nothing was lost",
        )
        self.failures = 0
        self._warned_at = -float("inf")
