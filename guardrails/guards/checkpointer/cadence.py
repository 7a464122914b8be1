"""Periodic saves that come due while the previous one is still being written: whether
it still is (on any rank), and what the skipped or delayed save says."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


def still_writing(guard: Guard, *, busy: bool) -> bool:
    """Whether the previous background save is still being written on any rank (the
    ranks must agree: a save is a collective commit); ``busy``: on this one. One
    all-reduce over the side group, only at a step where a periodic save is due."""
    if guard.side_group is None:
        return busy
    flag = torch.tensor([float(busy)])
    with guard.in_phase("agree"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=guard.side_group)
    return bool(flag[0])


def say_skipped(guard: Guard, *, writing: int, for_s: float, delayed: bool, first: bool) -> None:
    """The ``checkpoint_skipped`` event: the save of this step is skipped (or
    ``delayed``) while the save of step ``writing`` has been written for ``for_s``
    seconds; the advice comes with the ``first`` one."""
    what = "delayed until it is written" if delayed else "skipped"
    message = (
        f"checkpoint at step {guard.step} {what}: the save of step {writing} is still "
        f"being written ({for_s:.1f} s so far), and waiting would stall training."
    )
    if first:
        message += (
            " Saves come due faster than the disk writes them: save less often "
            "(checkpoint_every_n_steps / checkpoint_every_s), write to a faster disk, "
            "or pass guard(checkpoint=dict(strict_cadence=True)) to wait instead."
        )
    guard.event(
        "checkpoint_skipped",
        level="warning" if first else "info",
        message=message,
        step=guard.step,
        writing_step=writing,
        delayed=delayed,
    )
