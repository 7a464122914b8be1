"""The failure save's meeting place when the job's store is gone: files beside the
checkpoint, not keys in the store.

Outside torchrun rank 0's process hosts the job's TCPStore (``MASTER_ADDR``, SLURM's
``srun``): when rank 0 dies (the OOM killer, a SIGKILL, its node lost) the store goes with
it, and the survivors' failure save, which meets in the store, saved nothing: the restart
went back to the last periodic checkpoint (the recovery benchmark's node loss redid 703
steps). Under DDP every survivor still holds the whole model and optimizer and its own
part, and a rank on rank 0's host holds rank 0's published copy (``peer.py``), so the save
can still be whole. The ranks meet in a directory of the checkpoint root instead, which
every rank writes anyway (a multi-rank checkpoint's parts are written there by each rank):

* each rank claims the writing of its own part (``O_EXCL``: a rank late to its save and
  the committer writing its part from its copy never both write it), writes it into the
  step's temp directory, then files its record (the files it wrote, atomically renamed);
* the first rank done claims the commit. It writes the replicated state (its own copy),
  waits for the others' records (a rank that has not filed within the wait is dead or
  stuck), writes the parts of those it holds copies of, and commits, marking the
  manifest ``failure.store: "lost"`` and ``committed_by``;
* the others wait for the checkpoint to appear (one ``stat`` a poll), up to the limit.

The committer reads one directory listing a poll (O(N) at one rank, as the store's gather
reads N records at rank 0); every other rank does O(1) work. A board left by a rank
killed mid-save is a temp directory: the next save's clean-up removes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from guardrails.checkpoint import commit
from guardrails.checkpoint.manifest import incomplete
from guardrails.distributed.store import stretched
from guardrails.util import files as _perms

#: How often the committer lists the records, and the others look for the commit.
_POLL_S = 0.05


class FileBoard:
    """The meeting place of one failure save (``token``, ``step``) under ``root``."""

    def __init__(self, root: Path, token: str, step: int, world: int) -> None:
        # A temp directory of the save's own (the next save's clean-up removes a left one).
        self.path = commit.begin(root, step, f"{token}-board")
        self.final = root / f"step_{step:09d}"
        self.world = world

    def claim(self, name: str, by: str) -> bool:
        """Whether ``by`` is the first to claim ``name`` (one ``O_EXCL`` create)."""
        try:
            fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
        except FileExistsError:
            return False
        except OSError:  # the board is gone: the commit is over
            return False
        with os.fdopen(fd, "w") as f:
            f.write(by)
        return True

    def committer(self) -> int:
        """The rank that claimed the commit (-1 when the claim cannot be read)."""
        try:
            return int((self.path / "committer").read_text())
        except (OSError, ValueError):
            return -1

    def file(self, rank: int, record: dict[str, Any]) -> None:
        """This rank's record: the files it wrote (or ``{"none": why}``), whole or absent."""
        tmp = self.path / f".record{rank}"
        _perms.write_text(tmp, json.dumps(record))
        os.replace(tmp, self.path / f"record{rank}.json")

    def gather(self, *, wait_s: float, ranks: set[int]) -> dict[int, dict[str, Any]]:
        """The committer: the records filed within ``wait_s`` (sooner when every rank of
        ``ranks`` filed), by rank."""
        end = time.monotonic() + wait_s
        poll_s = stretched(_POLL_S, self.world)
        while True:
            names = [n for n in os.listdir(self.path) if n.startswith("record")]
            if ranks <= {int(n[6:-5]) for n in names} or time.monotonic() >= end:
                break
            time.sleep(poll_s)
        records = {}
        for name in names:
            with contextlib.suppress(OSError, ValueError):
                records[int(name[6:-5])] = json.loads((self.path / name).read_text())
        return records

    def await_commit(self, *, deadline: float) -> tuple[Path | None, list[int]]:
        """A rank other than the committer: the checkpoint once committed and the ranks
        its manifest says are missing, or ``(None, [])`` by ``deadline``."""
        manifest = self.final / "manifest.json"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                failure = json.loads(manifest.read_text()).get("failure") or {}
                return self.final, list(failure.get("missing", []))
            time.sleep(_POLL_S)
        return None, []

    def committed_whole(self) -> Path | None:
        """The step's checkpoint when it is already committed with no rank missing: rank
        0 committed it through the store, then exited with the store, and a rank whose
        save came later found the store gone. It must not commit an incomplete save over
        it (4 ranks, one killed: rank 3 did, with ranks 0-2 missing, seen in CI)."""
        with contextlib.suppress(OSError, ValueError):
            manifest = json.loads((self.final / "manifest.json").read_text())
            if incomplete(self.final, manifest) is None:
                return self.final
        return None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
