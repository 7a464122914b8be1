"""What one guard may ask of another: the contracts of the services in ``guard.shared``.

A guard that offers a service to the others publishes itself in a :class:`Shared` slot
(``engine/state.py``) at start and takes itself out at close; a guard that uses it reads
the slot and calls it. The engine imports no guard, and neither guard imports the
other, so the contract between them is written here, as a ``typing.Protocol``: the
slot is typed with it (``Shared.rewind: RewindService | None``), the guard that
provides it satisfies it structurally (no base class, no import), and the guard that
uses it calls only what it names. Two services:

* :class:`RewindService`: NanGuard asks the rewind guard (``guards/rewind``) to set the
  run back instead of raising on a streak of non-finite steps, and on a divergence.
* :class:`CollectiveRecorder`: GuardedDDP reports the all-reduces its comm hook issues
  to the collective auditor (``guards/audit``), NanGuard its flag agreement, and the
  error explainer reads the last calls it saw.

Checked by the tests: ``tests/test_layout.py`` reads every ``<x>.shared.<slot>`` in the
package and fails on a slot :class:`Shared` does not declare, or on a member of a
service that its protocol does not name; ``tests/test_structure.py`` checks that each
provider is an instance of its protocol, with the same signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class RewindService(Protocol):
    """What NanGuard may ask the rewind guard, at ``guard.shared.rewind`` (``None``:
    rewind is off, the default)."""

    def request(self, cause: str, start: int, numbers: dict[str, Any], *, everywhere: bool) -> bool:
        """Trouble began at step ``start`` (``cause``: ``"nonfinite"``, a streak of
        skipped steps; ``"divergence"``); ``numbers``: its evidence, for the event.
        ``everywhere``: every rank sees the same trouble at this same step. Returns
        whether a rewind is coming (``False``: the caller keeps its own behaviour)."""
        ...


@runtime_checkable
class CollectiveRecorder(Protocol):
    """What GuardedDDP, NanGuard and the error explainer may ask of the collective
    auditor, at ``guard.shared.auditor`` (``None``: single process, or audit off)."""

    @property
    def recent(self) -> Sequence[tuple[Any, ...]]:
        """This rank's most recent calls (raw entries, newest last)."""
        ...

    def record(
        self,
        op: str,
        tensors: Sequence[Tensor],
        *,
        group: Any = None,
        reduce_op: Any = None,
        site: str = "DDP gradient all-reduce",
    ) -> int:
        """Record a collective issued outside ``torch.distributed``'s Python API (a
        comm hook's all-reduce, possibly on the autograd thread): its sequence number
        on ``group``, or -1 once the recorder has stopped. Thread-safe, O(1)."""
        ...

    def record_own(self, what: str, tensor: Tensor, reduce_op: Any = None) -> None:
        """Record one of guardrails' own agreements (made on its side group, at a point
        of the loop every rank reaches) in the training group's sequence. Main thread."""
        ...
