"""What both sides of a checkpoint share: the directory names, the logger, small file helpers."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from guardrails._errors import CheckpointError, ResumeError
from guardrails.checkpoint import digest

# The manifest and the checks of a checkpoint's files, torch-free (`inspect` uses them).
from guardrails.checkpoint.files import not_regular
from guardrails.checkpoint.manifest import (
    ManifestError,
    _dumps,
)
from guardrails.checkpoint.manifest import read_manifest as _manifest_read
from guardrails.util import files as _perms
from guardrails.util.text import shorten

log = logging.getLogger("guardrails.checkpoint")


_TMP_PREFIX = ".tmp-"


_TRASH_PREFIX = ".trash-"


_ASIDE_PREFIX = ".aside-"


#: Tests only: SIGKILL this process at the named point of a commit (a real kill, in the
#: real process), to check that every point leaves a loadable checkpoint.
CRASH_ENV = "GUARDRAILS_TEST_CRASH_AT"


#: Header metadata key of a .safetensors file that maps alias key -> stored key.
ALIASES_KEY = "guardrails.aliases"

#: The tensors of the caller's extras (``g.state``), referenced from extras.json.
EXTRAS_TENSORS = "extras.safetensors"


def _crash_point(name: str) -> None:
    """Tests: a real SIGKILL of this process at commit point ``name`` when the
    environment asks for it (:data:`CRASH_ENV`)."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _read_tensors(path: Path) -> dict[str, Tensor]:
    """Inverse of :meth:`Part.add_tensors`: aliases point at the same tensor again.
    ``path`` must be a regular file (a FIFO would block the reader forever)."""
    why = not_regular(path)
    if why is not None:
        raise OSError(why)
    out: dict[str, Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            out[key] = f.get_tensor(key)
        aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
    for alias, key in aliases.items():
        out[alias] = out[key]
    return out


def _write_json(path: Path, obj: Any, files: dict[str, Any]) -> None:
    _write_bytes(path, _dumps(obj), files)


def _write_bytes(path: Path, data: bytes, files: dict[str, Any]) -> None:
    with os.fdopen(_perms.open_new(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    files[path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _seal(paths: Sequence[Path], files: dict[str, Any], prefix: str = "") -> None:
    """fsync files written by someone else (DCP, safetensors) and record each one's size
    and sha256 under ``prefix + name``, reading them back once, in parallel."""
    for path, record in zip(paths, digest.seal(paths), strict=True):
        files[prefix + path.name] = record


def _natural(key: str) -> tuple[str, int]:
    head, _, tail = key.rpartition(".")
    return (head, int(tail)) if tail.isdigit() else (key, -1)


def _short(items: list[Any], n: int = 5) -> str:
    return f"[{shorten(items, n)}]"


def _listing(path: Path, n: int = 8) -> str:
    if not path.exists():
        return "the path does not exist"
    if not path.is_dir():
        return "it is a file, not a directory"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "the directory is empty"
    return f"it holds {_short(names, n)}"


def _read_manifest(ckpt: Path) -> dict[str, Any]:
    try:
        return _manifest_read(ckpt)
    except ManifestError as e:
        raise _manifest_error(e) from None


def _manifest_error(e: ManifestError) -> CheckpointError | ResumeError:
    if e.too_new:
        return ResumeError(e.message, path=e.path, hint=e.hint, field=e.field)
    return CheckpointError(e.message, path=e.path, field=e.field)
