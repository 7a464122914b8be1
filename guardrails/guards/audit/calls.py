"""What the collective auditor records of one ``torch.distributed`` call: where each
op's tensor, reduce op, root, group and ``async_op`` sit in its arguments, the process
group it runs on (numbered per group), the user's call site, and the in-flight call the
watchdog shows. Read per call on the training's thread, so everything here is a table
lookup or a bounded frame walk (see ``auditor.py`` for the measured cost).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from guardrails.engine.where import PACKAGE_DIR, TORCH_DIR

# op -> (tensor arg position, reduce-op position, root (name, position), group position,
# async_op position, kind). Positions read off torch 2.13's signatures; they are the
# long-standing ones (e.g. ``gather(tensor, gather_list=None, dst=0, group=None,
# async_op=False)`` as documented since torch 1.8): newer releases only appended
# parameters (``group_src``/``group_dst``, ``timeout``). "tensor" is the argument whose
# shape must match on every rank (the input of gathers, the output of scatters). Kinds:
# "coll" is compared across ranks, "a2a" compares dtype only (split sizes may differ per
# rank), "p2p" is recorded but not compared.
_Spec = tuple[int | None, int | None, tuple[str, int] | None, int, int | None, str]
OPS: dict[str, _Spec] = {
    "all_reduce": (0, 1, None, 2, 3, "coll"),
    "broadcast": (0, None, ("src", 1), 2, 3, "coll"),
    "reduce": (0, 2, ("dst", 1), 3, 4, "coll"),
    "all_gather": (1, None, None, 2, 3, "coll"),
    "all_gather_into_tensor": (1, None, None, 2, 3, "coll"),
    "reduce_scatter": (0, 2, None, 3, 4, "coll"),
    "reduce_scatter_tensor": (0, 2, None, 3, 4, "coll"),
    # torch >= 2.13's names for the two above (which now call these).
    "all_gather_single": (1, None, None, 2, 3, "coll"),
    "reduce_scatter_single": (0, 2, None, 3, 4, "coll"),
    "gather": (0, None, ("dst", 2), 3, 4, "coll"),
    "scatter": (0, None, ("src", 2), 3, 4, "coll"),
    "barrier": (None, None, None, 0, 1, "coll"),
    "monitored_barrier": (None, None, None, 0, None, "coll"),
    "all_to_all_single": (1, None, None, 4, 5, "a2a"),
    "all_to_all": (1, None, None, 2, 3, "a2a"),
    "send": (0, None, ("dst", 1), 2, None, "p2p"),
    "recv": (0, None, ("src", 1), 2, None, "p2p"),
    "isend": (0, None, ("dst", 1), 2, -1, "p2p"),
    "irecv": (0, None, ("src", 1), 2, -1, "p2p"),
}


_TORCH_DIST_DIR = str(Path(dist.__file__).parent)
_FRAME_WALK = 8  # frames climbed out of torch.distributed at most (all_gather_object: 1)


class _Group:
    """What the auditor knows about one process group (cached per group object)."""

    __slots__ = ("name", "p2p", "pg", "ranks", "seq")

    def __init__(self, pg: Any, name: str, ranks: list[int]) -> None:
        self.pg = pg  # held so that id(pg) stays unique while cached
        self.name = name
        self.ranks = ranks
        self.seq = 0  # collectives issued on this group (compared across ranks)
        self.p2p = 0  # point-to-point calls (numbered apart: ranks differ legitimately)


def _user_frame(frame: Any) -> Any:
    """The first frame outside torch.distributed (bounded: torch's helpers nest 1-2)."""
    f = frame
    for _ in range(_FRAME_WALK):
        back = f.f_back
        if back is None:
            break
        f = back
        if not f.f_code.co_filename.startswith(_TORCH_DIST_DIR):
            return f
    return frame


def entry_dict(entry: tuple[Any, ...]) -> dict[str, Any]:
    """``guard.collective``: the in-flight call, for the watchdog (``op``, ``seq``,
    ``group``, ``shapes``, ``dtype``, ``site``, ``step``). Built per blocking call, so
    plain values only (~0.4 us); the watchdog formats them when it reports."""
    g, seq, op, _, shape, dtype, _, _, file, line, step, _ = entry
    return {
        "op": op,
        "seq": seq,
        "group": g.name,
        "shapes": None if shape is None else tuple(shape),
        "dtype": None if dtype is None else str(dtype),
        "site": f"{file}:{line}" if line else file,
        "step": step,
    }


_SUM = getattr(dist.ReduceOp, "SUM", None)
_MAX = getattr(dist.ReduceOp, "MAX", None)
#: How guardrails' own agreements are named in the audited sequence (see record_own).
OWN_PREFIX = "guardrails "


def is_own(entry: tuple[Any, ...]) -> bool:
    """Whether an audited entry is one of guardrails' own agreements (record_own)."""
    return str(entry[2]).startswith(OWN_PREFIX)


#: Frames that are not the user's loop: guardrails' own, and torch's (an optimizer's
#: step wrapper, an LR scheduler's).
_OWN_DIRS = (PACKAGE_DIR, TORCH_DIR)
_TENSOR_KW = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "output",
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "output",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": "",
    "monitored_barrier": "",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
