"""A dead rank's part of a failure save, written by a live rank from a copy of it: its own
copy on the writer's host (``peer.py``) or the mirror its partner on the next node keeps
(``partner.py``). The committer writes those of the missing ranks whose copies its host
holds; a partner writes the rank it keeps when that rank is gone, before its own part, so
that a node lost between the first and the last of several (whose mirrors are on a node
that does not commit) is whole too. Both read a copy the same way: of the save's step,
of its pass, with the streams of its boundary (:func:`usable`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails.guards.checkpointer import peer

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

    from guardrails.engine.guard import Guard
    from guardrails.guards.checkpointer.savepoint import SavePoint

#: How long a partner waits for its link to see the kept rank's connection end: the
#: failure the save follows and that end come from the same death, a moment apart.
_GONE_WAIT_S = 0.2


def usable(
    guard: Guard, directory: Path, token: str, rank: int, point: SavePoint
) -> tuple[peer.PeerPart | None, str]:
    """``rank``'s part of the save's ``point`` from a copy in ``directory``, or ``(None,
    why not)``."""
    step = point.step
    got, why = peer.read_peer(directory, token, rank, step=step)
    if got is None:
        return None, why
    if got.step != step:
        return None, f"its {got.source} is of step {got.step}, not {step}{got.note}"
    if got.epoch != point.epoch and not point.after_update:
        return None, f"its {got.source} is of another pass over the loader"
    if not got.streams_fresh and guard.boundary_capture.drawing:
        # The copy's python / numpy streams are an older boundary's: they are the last
        # one's when no rank draws from them between checks, which this rank, running
        # the same loop, tells (engine/boundary.py).
        return None, f"python's or numpy's stream in its {got.source} is not the last step's"
    return got, ""


#: Why the committer did not write a rank's part it holds a copy of: the rank claimed
#: it first, and its own record is on its way.
LATE = "it began to write its own part after the wait for it"


def held(guard: Guard, directory: Path, token: str, point: SavePoint, ranks: list[int]) -> set[int]:
    """Of ``ranks``, those whose part of ``point`` a copy in ``directory`` holds (their
    own copies on this host, the mirrors their partners keep here): the committer can
    write them without waiting for their ranks."""
    here = peer.ranks_with_copies(directory, token) & set(ranks)
    return {r for r in here if usable(guard, directory, token, r, point)[0] is not None}


def write_missing(
    guard: Guard,
    directory: Path,
    token: str,
    point: SavePoint,
    missing: list[int],
    claim: Callable[[int], bool],
    tmp: Path,
    files: dict[str, Any],
    cancel: threading.Event,
) -> tuple[dict[int, str], dict[int, str]]:
    """The committer: the parts of the ``missing`` ranks whose copies ``directory``
    holds, written into ``tmp`` (``files`` gets their records): the ranks written (by
    the copy's source) and why each other one was not. ``claim(r)``: whether the
    committer, not rank ``r`` itself, writes ``r``'s part (:data:`LATE` when not)."""
    written: dict[int, str] = {}
    notes: dict[int, str] = {}
    for r in missing:
        got, why = usable(guard, directory, token, r, point)
        if got is not None and not claim(r):
            got, why = None, LATE
        if got is None:
            notes[r] = why
            continue
        files.update(write(guard, got, point, tmp, cancel))
        written[r] = got.source
    return written, notes


def write(
    guard: Guard, got: peer.PeerPart, point: SavePoint, tmp: Path, cancel: threading.Event
) -> dict[str, Any]:
    """``got``'s part written into ``tmp``: its files' records."""
    files: dict[str, Any] = {}
    part = peer.stage_peer(guard, got, step=got.step, trained_at=point.position[0])
    part.cancel = cancel
    part.write(tmp, files)
    return files


def kept_gone(directory: Path, token: str, rank: int) -> bool:
    """Whether the rank this one keeps a mirror of is gone (its link ended without a
    goodbye), waiting a moment for the link to see it."""
    deadline = time.monotonic() + _GONE_WAIT_S
    while (gone := peer.mirror_gone(directory, token, rank)) is False:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return bool(gone)  # None: no mirror here
