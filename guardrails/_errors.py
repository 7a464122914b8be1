"""The guardrails exception tree.

Every error guardrails raises on purpose derives from :class:`GuardrailsError`, so one
``except guardrails.GuardrailsError`` catches them all, and each subclass names one
failure family from the debugging guides::

    GuardrailsError                 rank, step, hint, restartable (class attribute)
    ├── NonFiniteError              + cause        loss / grad went NaN or Inf
    ├── CollectiveMismatchError     + per_rank     ranks issued different collectives
    ├── HangError                   + stuck_ranks  no progress within hang_timeout_s
    ├── RankFailedError             + failed_rank  another rank died
    ├── UnevenDataError             + lengths      ranks ran out of data at different steps
    ├── ConfigMismatchError         + fields       ranks disagree on model / config / versions
    ├── LaunchError                 + check        the job was launched wrong (port, device, env)
    ├── CheckpointError             + path         a checkpoint is missing, truncated or corrupt
    ├── ResumeError                 + path         a checkpoint does not fit this model / run,
    │                                 changed      or was saved with another config
    └── OutOfMemoryError            + phase, memory, largest_tensors, remedies, per_rank
                                                   out of memory, explained (also a
                                                   torch.OutOfMemoryError)

The contract, for code that catches them:

* ``str(err)`` is the whole human message: what happened, where, the likely cause and
  the fix. It is written for the person reading the log, in the terms of their training loop.
* The structured fields (``rank``, ``step`` and the specifics of each subclass) are what
  programs should read; never parse the message.
* ``hint`` is the "what to do" part alone, also included in the message.
* ``restartable`` (a class attribute) says whether restarting the job can fix it: the
  same code on the same data gets past a dead rank, a hang or a pre-emption, but a
  desync, a config mismatch, uneven data or a checkpoint that does not fit fail the
  same way on every restart. ``@guardrails.record`` says which in its report, and a
  torchrun restart after an unfixable one is refused at once (``engine/last_failure.py``).
* Errors pickle with their fields, so they survive ``torch.multiprocessing`` and the
  torchelastic error file.

Misuse of the API (a wrong type, an unknown knob, iterating a closed guard) is not a
training failure and raises the ordinary ``TypeError`` / ``ValueError`` instead.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch


class GuardrailsError(Exception):
    """Root of every error guardrails raises about a training run.

    Args:
        message: what happened, in words.
        rank: the rank that observed the failure (``None`` outside distributed runs).
        step: the optimizer step at which it was observed (``None`` before the first).
        hint: what to do about it; appended to the message.
    """

    #: Whether a restart of the same job can get past this failure. False for a
    #: failure guardrails cannot classify: assume it recurs rather than loop through
    #: every restart (``guard(...)``'s own misuse reports, like DDP's unused parameters).
    restartable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        hint: str | None = None,
        **fields: Any,
    ) -> None:
        self.message = message
        self.rank = rank
        self.step = step
        self.hint = hint
        for name, value in fields.items():
            setattr(self, name, value)
        self._fields = dict(fields)
        super().__init__(self._render())

    def rehint(self, hint: str) -> GuardrailsError:
        """Replace the "what to do" part (and the rendered message with it): for a
        caller that knows the fix in the terms of the API the user called. Returns
        ``self``, to ``raise err.rehint(...)``."""
        self.hint = hint
        self.args = (self._render(),)
        return self

    def _render(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.step is not None:
            where.append(f"step {self.step}")
        text = f"[{', '.join(where)}] {self.message}" if where else self.message
        if self.hint:
            text += f"\n  fix: {self.hint}"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only constructors do not pickle through BaseException's default
        # (which replays self.args positionally); rebuild from the fields instead.
        kwargs = {"rank": self.rank, "step": self.step, "hint": self.hint, **self._fields}
        return (_rebuild, (type(self), self.message, kwargs))


def _rebuild(cls: type[GuardrailsError], message: str, kwargs: dict[str, Any]) -> GuardrailsError:
    return cls(message, **kwargs)


class NonFiniteError(GuardrailsError):
    """The loss or the gradients went NaN/Inf. ``cause`` classifies why
    (``optimization_blowup``, ``bad_data``, ``numerics``, ``fp16_overflow``,
    ``not_reproducible``)."""

    #: A restart resumes from the last checkpoint and replays the same batches with the
    #: same learning rate schedule: a blow-up or a bad batch comes back at that step.
    restartable: ClassVar[bool] = False

    cause: str | None

    def __init__(self, message: str, *, cause: str | None = None, **kw: Any) -> None:
        super().__init__(message, cause=cause, **kw)


class CollectiveMismatchError(GuardrailsError):
    """Ranks issued different collectives (op, shape, dtype or order).
    ``per_rank`` maps each rank to what it issued as collective number ``seq`` on
    ``group`` (``op``, ``shape``, ``dtype``, ``reduce_op``, ``root``, ``step``,
    ``site`` as ``file:line``), or ``{"seq": None, "issued": n}`` for a rank that had
    not issued that many yet. Raised by the :class:`~guardrails.CollectiveAuditor`."""

    #: Ranks that took different code paths take them again on the same code and data.
    restartable: ClassVar[bool] = False

    per_rank: dict[int, Any] | None
    #: The first collective number (1-based, per group) where the ranks differ.
    seq: int | None
    #: The process group's name (``"default"`` for the default group).
    group: str | None

    def __init__(
        self,
        message: str,
        *,
        per_rank: dict[int, Any] | None = None,
        seq: int | None = None,
        group: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(message, per_rank=per_rank, seq=seq, group=group, **kw)


class HangError(GuardrailsError):
    """No rank-wide progress within ``hang_timeout_s``. ``stuck_ranks`` names the ranks
    that stopped advancing."""

    #: Most hangs are the machine's (a stalled filesystem, a wedged GPU or NIC, a
    #: stuck loader worker): fresh processes get past them. A code path that waits
    #: forever recurs, but costs each restart one timeout, bounded by --max-restarts.
    restartable: ClassVar[bool] = True

    stuck_ranks: list[int] | None

    def __init__(self, message: str, *, stuck_ranks: list[int] | None = None, **kw: Any) -> None:
        super().__init__(message, stuck_ranks=stuck_ranks, **kw)


class RankFailedError(GuardrailsError):
    """Another rank died; ``failed_rank`` is the one that did."""

    #: A killed or crashed peer (the OOM killer, a lost node, a pre-emption) is the
    #: failure torchrun's restarts exist for.
    restartable: ClassVar[bool] = True

    failed_rank: int | None

    def __init__(self, message: str, *, failed_rank: int | None = None, **kw: Any) -> None:
        super().__init__(message, failed_rank=failed_rank, **kw)


class UnevenDataError(GuardrailsError):
    """Ranks ran out of data at different steps; ``lengths`` maps rank to batches seen."""

    #: The same data gives the same lengths on the next attempt.
    restartable: ClassVar[bool] = False

    lengths: dict[int, int] | None

    def __init__(self, message: str, *, lengths: dict[int, int] | None = None, **kw: Any) -> None:
        super().__init__(message, lengths=lengths, **kw)


class ConfigMismatchError(GuardrailsError):
    """Ranks disagree on something that must match; ``fields`` maps each differing
    field to its value per rank."""

    #: The ranks are given the same (mismatched) code, config and versions again.
    restartable: ClassVar[bool] = False

    fields: dict[str, Any] | None

    def __init__(self, message: str, *, fields: dict[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(message, fields=fields, **kw)


class LaunchError(GuardrailsError):
    """The job was launched in a way that cannot work (a port in use, a device ordinal
    past the visible GPUs, a wrong ``WORLD_SIZE``...), found before the first step or
    explained when torch failed on it. ``check`` names the check (``"master_port"``,
    ``"local_rank"``, ``"master_addr"``, ``"world_size"``, ``"cuda_visible_devices"``,
    ``"duplicate_device"``, ...)."""

    #: A restart launches the same way (same environment, world size and devices); a
    #: port another process holds is the exception, not the rule.
    restartable: ClassVar[bool] = False

    check: str | None

    def __init__(self, message: str, *, check: str | None = None, **kw: Any) -> None:
        super().__init__(message, check=check, **kw)


class CheckpointError(GuardrailsError):
    """A checkpoint could not be written or read back intact; ``path`` names the file,
    ``field`` the field of it that is wrong (``"step"``, ``'files["model.safetensors"]
    .bytes'``, ``"data.batch_in_epoch"``; ``None`` for the file as a whole)."""

    #: The same checkpoint is missing or corrupt on the next attempt too.
    restartable: ClassVar[bool] = False

    path: str | None
    field: str | None

    def __init__(
        self, message: str, *, path: str | None = None, field: str | None = None, **kw: Any
    ) -> None:
        super().__init__(message, path=path, field=field, **kw)


class ResumeError(GuardrailsError):
    """A checkpoint is intact but cannot be applied to this model / optimizer / run.
    ``changed``: when the run's ``config`` differs from the one the checkpoint was saved
    with, each differing key (nested keys joined with ``.``) mapped to ``(saved, given)``
    (``"(absent)"`` for a key one side lacks); else ``None``. ``field``: the field of the
    file at ``path`` that does not fit, where one does (``"data.batch_in_epoch"``)."""

    #: The checkpoint and the model or config are the same on the next attempt.
    restartable: ClassVar[bool] = False

    path: str | None
    changed: dict[str, tuple[Any, Any]] | None
    field: str | None

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        changed: dict[str, tuple[Any, Any]] | None = None,
        field: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(message, path=path, changed=changed, field=field, **kw)


class OutOfMemoryError(GuardrailsError, torch.OutOfMemoryError):
    """An out-of-memory error in the guarded loop, explained. ``phase`` says where
    (``"data"``, ``"forward"``, ``"backward"``, ``"optimizer"``, ``"loop"``, ``"setup"``),
    ``memory`` holds the allocator's numbers in bytes, ``largest_tensors`` the biggest
    live tensors, ``remedies`` the usual fixes ranked by those numbers (keys, most
    likely first) and ``per_rank`` other ranks' memory when distributed.

    Also a ``torch.OutOfMemoryError`` (so a ``RuntimeError``): code that catches torch's
    error keeps working. The error torch raised is its ``__cause__``."""

    #: An out-of-memory error mid-run mostly comes from fragmentation, a leak or a rare
    #: long batch, and a fresh process starts with an empty allocator. One at the first
    #: step (the model does not fit) recurs, costing each restart one startup, bounded
    #: by --max-restarts.
    restartable: ClassVar[bool] = True

    phase: str | None
    memory: dict[str, Any] | None
    largest_tensors: list[dict[str, Any]] | None
    remedies: list[str] | None
    per_rank: dict[int, Any] | None

    def __init__(
        self,
        message: str,
        *,
        phase: str | None = None,
        memory: dict[str, Any] | None = None,
        largest_tensors: list[dict[str, Any]] | None = None,
        remedies: list[str] | None = None,
        per_rank: dict[int, Any] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(
            message,
            phase=phase,
            memory=memory,
            largest_tensors=largest_tensors,
            remedies=remedies,
            per_rank=per_rank,
            **kw,
        )
