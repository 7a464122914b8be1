"""The collective-mismatch report: the verdict the ranks agreed on (each rank's calls
from the first differing one) turned into the error every rank raises, in the user's
terms: which call on which rank at which line, what that does to a job, and the fix.
"""

from __future__ import annotations

from typing import Any

from guardrails._errors import CollectiveMismatchError


def _describe(e: dict[str, Any] | None) -> str:
    if e is None:
        return "-"
    red = f"({e['reduce_op']})" if e.get("reduce_op") else ""
    root = f" root={e['root']}" if e.get("root") is not None else ""
    tensor = f" {e['dtype']}{e['shape']}" if e.get("dtype") else ""
    step = f", step {e['step']}" if e.get("step") is not None else ""
    return f"#{e['seq']} {e['op']}{red}{tensor}{root} at {e['site']}{step}"


def _error(verdict: dict[str, Any], rank: int, step: int | None) -> CollectiveMismatchError:
    seq, group = verdict["seq"], verdict["group"]
    per_rank: dict[int, Any] = {}
    lines = []
    for r_s, info in sorted(verdict["per_rank"].items(), key=lambda kv: int(kv[0])):
        r = int(r_s)
        entries = info["entries"]
        at_first = next((e for e in entries if e["seq"] == seq), None)
        per_rank[r] = at_first if at_first is not None else {"seq": None, "issued": info["n"]}
        if not entries:
            lines.append(
                f"  rank {r}: has issued {info['n']} collective(s) on this group, not #{seq} yet"
            )
            continue
        shown = "; then ".join(_describe(e) for e in entries[:3])
        lines.append(f"  rank {r}: {shown}")
    where = "the default group" if group == "default" else f"group {group}"
    ranks = verdict.get("ranks", [])
    message = (
        f"collective mismatch on {where} (ranks {_span(ranks)}): the ranks' sequences of "
        f"collectives differ from collective #{seq} on.\n"
        + "\n".join(lines)
        + "\n  Ranks pair collectives by their order, so from here each rank exchanges data "
        'with a different call: the job hangs (NCCL), dies in the backend (gloo: "Is there '
        'a distributed collective mismatch", "Connection reset by peer"), or, with equal '
        "shapes, silently mixes unrelated tensors.\n"
        "  Likely cause: a collective that only some ranks reach (an `if rank == 0:` branch "
        "around logging, evaluation or checkpointing that calls one, a data-dependent branch, "
        "an early `break`), or ranks issuing the same collectives in a different order."
    )
    hint = (
        "make every rank issue the same collectives in the same order: at the lines above, "
        "move the collective out of the rank- or data-dependent branch (run it on every rank "
        "and use the result only where needed), or guard the whole branch by a decision all "
        "ranks share (e.g. the step number), not by the rank."
    )
    return CollectiveMismatchError(
        message, rank=rank, step=step, hint=hint, per_rank=per_rank, seq=seq, group=group
    )


def _span(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
