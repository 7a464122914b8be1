"""``run_dir/live/``: what a running job shows of itself to ``guardrails top`` and
``guardrails stacks``, and what ``report`` shows of a run's last moment. No torch.

The files (each written whole: a temporary name, then a rename, so a reader never sees
half of one):

* ``live/node<K>.json``: node K's last snapshot, one record per rank of the node,
  written by the node's lowest local rank (``guards/watchdog/live.py``; a single
  process: ``node0.json``, its one record);
* ``live/stacks.request``: a request for every rank's stacks (``{"id", "time"}``),
  written by ``guardrails stacks``;
* ``live/stacks/<id>/node<K>.json``: node K's answer, every thread's stack of every
  rank of the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from guardrails.util import files

#: The folder inside ``run_dir``.
LIVE_DIR = "live"
#: The request file ``guardrails stacks`` writes, in :data:`LIVE_DIR`.
REQUEST_FILE = "stacks.request"
#: A request older than this when a rank first sees it is left unanswered: one written
#: while nobody ran (the job started after the command gave up on it).
REQUEST_FRESH_S = 60.0


def live_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / LIVE_DIR


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``, whole or not at all (a temporary name, then a rename:
    the readers of a shared filesystem never see a torn file)."""
    files.make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    files.write_text(tmp, json.dumps(obj, default=str, separators=(",", ":")))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``, or ``None`` (missing, unreadable, not an object)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def node_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    return sorted(live_dir(run_dir).glob("node*.json"))


def read_snapshot(run_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every rank's last published record, from every node's file: rank -> record,
    each with ``written`` (when its node file was written, ``time.time()``) and
    ``node``. Empty when the job published nothing (not started, its watchdog off, a
    guardrails without the live view). The newest run in ``run_dir`` wins a rank."""
    out: dict[int, dict[str, Any]] = {}
    for path in node_files(run_dir):
        node = read_json(path)
        if node is None:
            continue
        for rank, rec in (node.get("ranks") or {}).items():
            rec = {**rec, "written": node.get("time"), "node": node.get("node")}
            old = out.get(int(rank))
            if old is None or rec.get("started", 0) >= old.get("started", 0):
                out[int(rank)] = rec
    return out


def request_stacks(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Ask every rank of the job in ``run_dir`` for its stacks; the request written."""
    request = {"id": uuid.uuid4().hex[:12], "time": time.time()}
    write_json(live_dir(run_dir) / REQUEST_FILE, request)
    return request


def answers_dir(run_dir: str | os.PathLike[str], request_id: str) -> Path:
    return live_dir(run_dir) / "stacks" / request_id


def read_answers(run_dir: str | os.PathLike[str], request_id: str) -> dict[int, dict[str, Any]]:
    """rank -> its answer to request ``request_id``, from every node's answer file."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(answers_dir(run_dir, request_id).glob("node*.json")):
        node = read_json(path)
        for rank, answer in ((node or {}).get("ranks") or {}).items():
            out[int(rank)] = answer
    return out


def remove_answers(run_dir: str | os.PathLike[str], request_id: str) -> None:
    """The command's clean-up once it printed the answers: they are a moment's."""
    folder = answers_dir(run_dir, request_id)
    for path in folder.glob("*"):
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()
