"""The buffers a training forward writes in place (BatchNorm's running statistics), and
their shadows: what a skipped step puts back.

A NaN batch through a BatchNorm layer writes NaN into ``running_mean`` / ``running_var``
during the training forward, before any gradient exists; skipping the update alone
leaves them there, and every later evaluation is NaN. So the engine keeps a copy of the
written buffers as they were before the step's first training forward (a fused copy
per dtype a step, no sync; nothing for a model whose forward writes no buffer) and, when a
step is skipped, whoever skips it (a component through ``Guard.skip_update``, or a
GradScaler that found the gradients non-finite), puts back the buffers of the models
that optimizer trains.

Which buffers: the first step finds them, by value (BatchNorm updates its statistics in
a kernel that does not bump their version counters): a copy of every buffer at the
step's first forward, compared at the first optimizer step, once per run.

Whose buffers: an optimizer's skip puts back the buffers of the models holding one of
its parameters (with one model, all of them). A GAN's discriminator step skipped on a
NaN real batch puts back the discriminator's statistics and leaves the generator's,
whose step goes on, as they are.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

#: The integer dtype of each element size: a buffer's bytes as integers (_bits).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: Tensor) -> Tensor:
    """``t``'s bytes as integers of its element size (a view: no copy)."""
    return (
        t
        if not t.is_floating_point() and t.dtype != torch.bool
        else t.view(_INT_OF_SIZE[t.element_size()])
    )


class _Group:
    """One optimizer's buffers with their shadows, as the fused calls take them."""

    def __init__(self, names: list[str], bufs: list[Tensor], shadows: list[Tensor]) -> None:
        self.names = names
        self.bufs = bufs
        self.shadows = shadows
        # Integer views of both, same bytes: the restore by a device flag is exact
        # integer arithmetic (x * 1 + y * 0), which a NaN cannot poison.
        self.buf_bits = [_bits(b) for b in bufs]
        self.shadow_bits = [_bits(s) for s in shadows]
        # (shadows, buffers) of one dtype and device each: a foreach call over mixed
        # dtypes (BatchNorm's float statistics and int64 num_batches_tracked) takes
        # torch's slow path, a kernel per tensor: ResNet-50's 159 buffers cost 860 us
        # a copy on an H200, 63 us split by dtype (torch 2.11).
        kinds: dict[tuple[torch.dtype, torch.device], tuple[list[Tensor], list[Tensor]]] = {}
        for b, s in zip(bufs, shadows, strict=True):
            pair = kinds.setdefault((b.dtype, b.device), ([], []))
            pair[0].append(s)
            pair[1].append(b)
        self.to_shadows = list(kinds.values())
        self.to_bufs = [(b, s) for s, b in self.to_shadows]

    def copy(self, pairs: list[tuple[list[Tensor], list[Tensor]]]) -> None:
        """``dst <- src`` for each (dst, src) pair of lists: one fused call per dtype."""
        for dst, src in pairs:
            torch._foreach_copy_(dst, src)


class BufferShadows:
    """The model's written buffers, their shadows, and each optimizer's share of them.

    ``model``: the guard's model (the one given, or a ``ModuleDict`` of several), whose
    buffer names are reported; ``models`` and ``optimizers``: the guard's, by name."""

    def __init__(
        self,
        model: nn.Module,
        models: Mapping[str, nn.Module],
        optimizers: Mapping[str, torch.optim.Optimizer],
    ) -> None:
        self._model = model
        self._models = models
        self._optimizers = optimizers
        #: True from the first training forward until the first optimizer step of the
        #: run, which keeps the written buffers (:meth:`settle`).
        self.pending = False
        #: Whether :meth:`snapshot` has anything to do: until the first step, and after
        #: it while buffers are written (False for most models: the engine skips the
        #: call).
        self.active = True
        self._started = False
        self._all = _Group([], [], [])
        self._groups: dict[str, _Group] = {}
        # The first step only: every buffer and a copy, to find the written ones.
        self._candidates: list[tuple[str, Tensor, Tensor]] = []

    @property
    def names(self) -> list[str]:
        """The written buffers' names (empty before the first step and for a model whose
        forward writes no buffer)."""
        return self._all.names

    def names_of(self, optimizer: str) -> list[str]:
        """The buffers a skip of ``optimizer`` puts back."""
        group = self._groups.get(optimizer)
        return [] if group is None else group.names

    def snapshot(self) -> None:
        """The step's first training forward is about to run: the written buffers as
        they are now (one fused copy per dtype, no sync; nothing when no buffer is written). The
        run's first: a copy of every buffer, to find the written ones."""
        group = self._all
        if group.shadows:
            group.copy(group.to_shadows)
        elif not self._started:
            self._started = self.pending = True
            from guardrails.engine.model import unwrap

            seen: set[int] = set()
            for name, b in unwrap(self._model).named_buffers():
                # Buffers whose bytes an integer view covers (every real one; not complex).
                if id(b) in seen or b.element_size() not in _INT_OF_SIZE or b.is_complex():
                    continue
                seen.add(id(b))
                self._candidates.append((name, b, b.detach().clone()))

    def settle(self) -> None:
        """The run's first optimizer step is next: keep, of the buffers, those the
        forwards changed (on CUDA one host read per buffer, once per run), and each
        optimizer's share of them."""
        from guardrails.engine.model import unwrap

        self.pending = False
        kept, self._candidates = [c for c in self._candidates if not torch.equal(c[1], c[2])], []
        self.active = bool(kept)
        if not kept:
            return
        self._all = _Group([n for n, _, _ in kept], [b for _, b, _ in kept], [c for *_, c in kept])
        of_model = {
            mname: (
                {id(p) for p in m.parameters()},
                {id(b) for b in unwrap(m).buffers()},
            )
            for mname, m in self._models.items()
        }
        for oname, opt in self._optimizers.items():
            params = {id(p) for g in opt.param_groups for p in g["params"]}
            mine: set[int] = set()
            for mparams, mbufs in of_model.values():
                if not params.isdisjoint(mparams):
                    mine |= mbufs
            if all(id(b) in mine for b in self._all.bufs):
                self._groups[oname] = self._all  # the common case: one list for all
                continue
            idx = [i for i, b in enumerate(self._all.bufs) if id(b) in mine]
            self._groups[oname] = _Group(
                [self._all.names[i] for i in idx],
                [self._all.bufs[i] for i in idx],
                [self._all.shadows[i] for i in idx],
            )

    def put_back(
        self, optimizer: str, *, skip: bool, where: Tensor | None, this_step: bool
    ) -> None:
        """``optimizer``'s step is skipped (``skip``) or skipped on the device where the
        flag ``where`` is set: its buffers go back as they were before the step's first
        forward. ``this_step``: a training forward ran this step (else the shadows are
        an earlier step's, and nothing is put back)."""
        if not this_step:
            return
        if skip:
            self.restore(optimizer)
        elif where is not None:
            self.restore_where(where, optimizer)

    def restore(self, optimizer: str) -> None:
        """``optimizer``'s step is skipped: its buffers as they were before the step's
        first forward, bitwise (one fused copy per dtype)."""
        group = self._groups.get(optimizer)
        if group is not None and group.bufs:
            group.copy(group.to_bufs)

    def restore_where(self, flag: Tensor, optimizer: str) -> None:
        """The optimizer skips on the device where ``flag`` is set: its buffers follow,
        also on the device. Integer views, so ``buf * keep + shadow * skip`` is exact
        and a NaN in the buffer cannot leak through a multiplication by zero. Four
        fused calls, no sync."""
        group = self._groups.get(optimizer)
        if group is None or not group.bufs:
            return
        skip = (flag != 0).to(torch.int64)
        torch._foreach_mul_(group.buf_bits, 1 - skip)
        torch._foreach_add_(group.buf_bits, torch._foreach_mul(group.shadow_bits, skip))

    def nonfinite(self) -> list[str]:
        """The names of the written buffers holding a NaN or an Inf now (one host read:
        call it rarely, e.g. before reporting a recovery or on a skipped step)."""
        group = self._all
        floats = [
            (n, b) for n, b in zip(group.names, group.bufs, strict=True) if b.is_floating_point()
        ]
        if not floats:
            return []
        finite = torch.stack([torch.isfinite(b).all() for _, b in floats]).tolist()
        return [n for (n, _), ok in zip(floats, finite, strict=True) if not ok]
