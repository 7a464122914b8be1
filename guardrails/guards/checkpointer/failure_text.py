"""What the failure save (``failure.py``) says: the error it followed, in one line, the
manifest's ``failure`` record and the ``failure_saved`` event's message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The most of an error's first line the manifest and the event keep (gloo's run to 300).
_CAUSE_CHARS = 160


def cause(error: BaseException) -> str:
    """The error's class and first line: what the manifest and the event say."""
    first = str(error).splitlines()[0] if str(error) else ""
    if len(first) > _CAUSE_CHARS:
        first = first[: _CAUSE_CHARS - 3] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def message(
    when: str,
    kind: str,
    step: int,
    path: Path | None,
    missing: list[int],
    took_s: float,
    *,
    why: str,
    notes: dict[int, str],
    rerun: str,
    part_only: bool,
    committer: int,
) -> str:
    """The event's message: the run failed ``when`` (``kind``: the error's class), and
    what was saved of ``step``: whole at ``path``, without the ``missing`` ranks (``notes``:
    why their copies could not stand in), this rank's part only (``part_only``: rank
    ``committer`` commits it later), or nothing (``why``); ``rerun``: what a re-run does."""
    if path is not None and not missing:
        return (
            f"the run failed {when} ({kind}); the state of step {step}, the "
            f"last finished step, was saved to {path} in {took_s:.1f} s: run the same "
            "command to continue from it (resume='auto')."
        )
    if path is not None:
        unreached = "; ".join(f"rank {r}: {note}" for r, note in notes.items())
        return (
            f"the run failed {when} ({kind}); step {step} was saved to {path} "
            f"without rank(s) {missing} (dead or stuck: their RNG streams and data "
            f"position are missing{f'; {unreached}' if unreached else ''}), so it is "
            f"incomplete and resume='auto' will not use it; {rerun}."
        )
    if part_only:
        return (
            f"the run failed {when} ({kind}); this rank wrote its part of the "
            f"failure save of step {step} (its RNG streams and data position), which "
            f"rank {committer} commits once it fails too."
        )
    return f"the run failed {when} ({kind}); nothing was saved: {why}; {rerun}."


def record(
    cause: str,
    missing: list[int],
    *,
    after: list[int],
    peers: list[int],
    by_partner: list[int],
    committer: int,
    store_lost: bool,
) -> dict[str, Any]:
    """The manifest's ``failure``: which state (``"live"``: the last finished step's;
    ``"after_update"``: the failing step's update was over, ``after_update`` names the
    ranks whose streams and position are those after it), the ranks missing, those whose
    part a live rank wrote from their published copy (``from_peers``; ``by_partner``: of
    those, the ones their partner on the next node wrote), and the committer when it is
    not rank 0."""
    failure: dict[str, Any] = {
        "cause": cause,
        "state": "after_update" if after else "live",
        "missing": missing,
    }
    if after:
        failure["after_update"] = after
    if peers:
        failure["from_peers"] = peers
    if by_partner:
        failure["by_partner"] = by_partner
    if committer != 0:
        failure["committed_by"] = committer
    if store_lost:
        failure["store"] = "lost"
    return failure
