"""Which state a failure save writes (``failure.py``): the step, and the RNG streams, data
position and host-side state that belong to that step.

* From the main thread, or on the CPU, the host's counters are the truth: the live model
  and optimizers are the last finished step's until ``optimizer.step()`` begins
  (``guard.update_began``), with the last boundary's RNG streams and data position
  (``engine/boundary.py``); once the failing step's update is over (``phase`` no longer
  ``"optimizer"``, one optimizer) they are the new step's, with the streams and
  position as they are then (``after_update``). Inside ``optimizer.step()``: nothing.
* From the watchdog's thread on a GPU (the main thread stuck), the device may be behind
  its host: it is asked which step its weights are (``UpdateMarks.device_step``). The
  host's last step: saved as above. One step before it (the GPU still waits in the
  all-reduce of the update the host queued last, the common case when a DDP peer dies
  over NCCL): the boundary before, with what the host held just before that update
  (``boundary.Before``: the optimizer's hyperparameters, the schedulers' state), and
  after the copy the device must still hold that step (:meth:`SavePoint.still_held`).
  An optimizer that keeps state on the host (a non-fused AdamW's step counts) cannot
  be taken back a step: then nothing, said with the fix. Without the marks (several
  optimizers) only an idle device is known to hold the host's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from guardrails.checkpoint import stage
from guardrails.engine import model

if TYPE_CHECKING:
    from guardrails.engine.boundary import Before, UpdateMarks
    from guardrails.engine.guard import Guard


@dataclass
class SavePoint:
    """A failure save's state: ``step`` (the checkpoint's), ``rng`` (the streams,
    as ``stage.stage_rank`` takes them), ``position`` (``(trained_at, batches fetched
    since)``) and ``epoch`` of its boundary; ``after_update``: the failing step's update
    was over, the streams and position are those after it. ``before``: the device is a
    step behind the host, whose state before its last update this is. ``refetch_from``:
    of ``position``'s batches, those from this index on were fetched after ``rng`` was
    taken (inside the failing step): a fast-forwarded loader fetches them again from it
    (one that draws from the RNG, nanoGPT's ``get_batch``, would otherwise hand them out
    without their draws); ``None``: all were fetched before."""

    step: int
    rng: dict[str, Any]
    position: tuple[Any, list[Any]]
    epoch: int
    after_update: bool = False
    before: Before | None = None
    marks: UpdateMarks | None = None
    refetch_from: int | None = None

    @property
    def generator_states(self) -> dict[str, Any] | None:
        """The loop's own generators (``guard(generators=)``) as the step left them;
        ``None``: as the guard holds them."""
        return None if self.before is None else self.before.generator_states

    def data(self, guard: Guard) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The data position a save of this point writes (``DataPosition.save``): of
        its boundary, the batches fetched after its streams fetched again where the
        loader allows (:attr:`refetch_from`)."""
        return guard.data_position.save(boundary=self.position, refetch_from=self.refetch_from)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any] | None:
        """``optimizer``'s state dict to save when the device is behind: the device's
        tensors with the hyperparameters from before the host's update. ``None``: its own
        ``state_dict()`` (the device holds the host's step)."""
        if self.before is None:
            return None
        sd = stage.per_rank(optimizer).state_dict()
        for group, held in zip(sd["param_groups"], self.before.groups, strict=True):
            group.update(held)
        return sd

    @property
    def scheduler_states(self) -> dict[str, Any] | None:
        """The schedulers' state dicts from before the host's update, by name; ``None``:
        their own."""
        return None if self.before is None else self.before.schedulers

    def still_held(self) -> bool:
        """After the copy: whether the device still holds :attr:`step`'s weights (its
        next update has not begun), so the copy is of that step alone."""
        return self.marks is None or self.marks.holds(self.step)


def choose(
    guard: Guard, *, from_thread: bool, weights: bool, training: Any
) -> tuple[SavePoint | None, str]:
    """The state this rank saves, or ``(None, why not)`` (the module docstring).
    ``weights``: this rank's part holds device state; ``training``: the training stream
    (the main thread's at start)."""
    cuda = guard.device is not None and guard.device.type == "cuda"
    marks = guard.boundary_capture.updates
    if from_thread and cuda and marks is not None:
        held = marks.device_step()
        if held is None:
            return None, (
                "the main thread is stuck and its GPU is inside an update or more than a "
                "step behind it: the weights there are no finished step's"
            )
        before = marks.before
        inside = guard.update_began and guard.phase == "optimizer"
        if held == guard.step - 1 or (held == guard.step and inside):
            if before is None or before.step != held:
                return None, f"what the host held at step {held} was not kept"
            return _behind(guard, before, marks)
        if held != guard.step:
            return None, f"its GPU holds step {held}'s weights, its host step {guard.step}'s"
    elif from_thread and cuda and weights:  # no marks (several optimizers): idle or not
        if guard.update_began:
            return None, (
                "the main thread is stuck after optimizer.step() began, and the update may "
                "still be queued on the GPU"
            )
        if not stage.device_idle(training):
            return None, (
                "the main thread is stuck and its GPU has not finished the work it was "
                "given (queued behind a collective whose peer is gone, say): the weights "
                "there may be an older step's"
            )
    return _host(guard)


def _host(guard: Guard) -> tuple[SavePoint | None, str]:
    """The host's last finished step (or, past the failing step's update, the new one)."""
    if guard.update_began and not _after_the_update(guard):
        return None, (
            "the failure came inside optimizer.step(): the live weights are neither "
            "those of the step before nor those of the step after"
        )
    pos = guard.data_position
    batches = [*guard.step_batches, *pos.fetched]
    if guard.update_began:  # after the update: the step it made, streams as they are
        position = (pos.trained_at, batches)
        return SavePoint(guard.step, stage.current_streams(), position, guard.epoch, True), ""
    capture = guard.boundary_capture
    rng, why = capture.rng_at_boundary()
    if rng is None:
        return None, why
    if capture.epoch != guard.epoch:
        return None, "the failing step began a new pass over the loader"
    position = (capture.trained_at, batches)
    return SavePoint(guard.step, rng, position, capture.epoch, refetch_from=capture.held), ""


def _behind(guard: Guard, before: Before, marks: UpdateMarks) -> tuple[SavePoint | None, str]:
    """The device holds ``before.step``, the host is past it: that step, with the host's
    state from before its update."""
    step = before.step
    if model.holds_shards(guard.model):  # saved through DCP, which reads its own state
        return None, (
            f"its GPU is still at step {step}, a step behind its host, and the model is "
            "sharded (its state is saved as it is now, not as it was at that step)"
        )
    for sd in [stage.per_rank(o).state_dict() for o in guard.optimizers.values()]:
        on_host = sorted(
            {k for s in sd["state"].values() for k, v in s.items() if _on_host(v)}
        )  # the step counts of a non-fused AdamW: already counted past the device
        if on_host:
            return None, (
                f"its GPU is still at step {step}, a step behind its host, and the optimizer "
                f"keeps {', '.join(on_host)} on the host, already a step ahead; an optimizer "
                "with its state on the GPU (AdamW(..., fused=True)) lets this save be made"
            )
    if any(isinstance(v, Tensor) for group in before.groups for v in group.values()):
        return None, "an optimizer hyperparameter is a tensor the host may have changed since"
    rng, why = before.rng()
    if rng is None:
        return None, why
    if before.epoch != guard.epoch:
        return None, "the failing step began a new pass over the loader"
    pos = guard.data_position
    later = [] if guard.step_batches is before.batches else guard.step_batches
    position = (before.trained_at, [*before.batches, *later, *pos.fetched])
    return SavePoint(
        step, rng, position, before.epoch, before=before, marks=marks, refetch_from=before.held
    ), ""


def _on_host(value: Any) -> bool:
    """An optimizer state entry that lives on the host (a CPU tensor, a number)."""
    return not isinstance(value, Tensor) or value.device.type == "cpu"


def _after_the_update(guard: Guard) -> bool:
    """Whether the failing step's update is over (its ``optimizer.step()`` returned,
    the step count moved on: ``phase`` is no longer ``"optimizer"``) and the live
    weights are the new step's: a hang in a logging all-reduce or an eval after the
    update. With several optimizers one may not have stepped yet: not then."""
    return guard.phase != "optimizer" and len(guard.optimizers) == 1
