"""What guardrails creates is never writable by group or others, whatever the umask.

A job started with ``umask 000`` (some cluster launchers and containers set it) made
every run dir, metrics part, event log and checkpoint world-writable: anyone on a shared
disk could then replace a checkpoint's files, or plant files in its directory, before
the next resume. The umask only ever removes bits from the mode a file is created with,
so an explicit mode without group/other write (0o755 directories, 0o644 files) is
enough for what guardrails opens itself; what a library writes with its own mode
(safetensors, pyarrow, torch.distributed.checkpoint) is ``chmod``-ed after it is
written, before it is renamed into place. Stricter umasks (077) stay in force: bits are
only taken away, never added. Directories that existed before (a run dir the user made)
are left as they are. No torch: the report and the compactor use this too.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

#: Modes guardrails creates with; the umask may take more bits away, never add.
DIR_MODE = 0o755
FILE_MODE = 0o644
_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def make_dirs(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p path``, each directory it creates ``0o755`` (less what the umask
    removes). ``Path.mkdir(parents=True)`` gives the parents it creates ``0o777`` less
    the umask, world-writable under umask 000, whatever mode is passed."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another rank made it first: theirs
            os.mkdir(d, DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    return path


def open_new(path: str | os.PathLike[str], flags: int = 0) -> int:
    """``os.open`` for writing a file guardrails creates, mode ``0o644``, never through
    a symbolic link in its place (``O_NOFOLLOW``: a link planted there would have the
    write truncate whatever it points to)."""
    flags |= os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    return os.open(path, flags, FILE_MODE)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a new file, mode ``0o644``."""
    with os.fdopen(open_new(path), "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode())


def restrict(path: str | os.PathLike[str]) -> None:
    """Take group and other write off ``path`` (a file or directory a library created
    with its own mode). Symlinks are not followed. Best effort, silent: a file another
    user owns cannot be changed, and that must not fail a save."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not st.st_mode & _GROUP_OTHER_WRITE:
            return
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~_GROUP_OTHER_WRITE)
    except OSError:  # another user's file, or gone (a part compacted meanwhile)
        pass


def restrict_tree(root: str | os.PathLike[str]) -> None:
    """:func:`restrict` ``root`` and everything under it (a checkpoint's or a
    diagnosis' temp directory, before its rename: nothing else writes there)."""
    restrict(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            restrict(os.path.join(dirpath, name))


def fsync_path(path: Path | str) -> None:
    """fsync a file or a directory by path (a directory: so a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
