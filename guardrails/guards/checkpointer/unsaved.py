"""What the loop keeps that no checkpoint saves, told at the run's first step: an LR
scheduler, a ``torch.Generator``, an EMA of the model not passed to ``guard()``, and an
epoch loop that counts from 0 (``data.warn_epoch_loop_from_zero``). Part of
:class:`SignalCheckpointer`.

At the first step, not the first save: without periodic saves the first save is the
SIGTERM's, the one the warning was there to make right. One scan of the calling stack's
variables, once a run (rank 0).
"""

from __future__ import annotations

import gc
import logging
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from guardrails.engine import data as _data
from guardrails.engine import model, where

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

log = logging.getLogger("guardrails.checkpoint")


def _user_spaces(frame: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(site, variables)`` of each frame of the user's code from ``frame`` outwards:
    its locals, then its module's globals (once each). ``site`` is
    ``"file, function()"``."""
    seen: set[int] = set()
    while frame is not None:
        code = frame.f_code
        if where.is_user_file(code.co_filename):
            site = f"{Path(code.co_filename).name}, {code.co_name}()"
            yield site, where.frame_locals(frame)
            if id(frame.f_globals) not in seen:
                seen.add(id(frame.f_globals))
                yield site, frame.f_globals
        frame = frame.f_back


def stack_generators(guard: Guard, frame: Any) -> dict[int, tuple[torch.Generator, str, str]]:
    """The ``torch.Generator``s in variables of the user's code on the stack from
    ``frame`` out that no checkpoint saves: not passed as ``guard(generators=...)``, not
    the loader's or sampler's, not torch's default ones. By ``id``: ``(generator,
    variable, "file, function()")``."""
    saved = {id(g) for g in guard.generators.values()}
    saved |= {id(g) for g in _data.loader_generators(guard.loader).values()}
    saved.add(id(torch.default_generator))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        saved |= {id(g) for g in torch.cuda.default_generators}
    found: dict[int, tuple[torch.Generator, str, str]] = {}
    for site, space in _user_spaces(frame):
        for name, value in list(space.items()):
            if isinstance(value, torch.Generator) and id(value) not in saved:
                found.setdefault(id(value), (value, name, site))
    return found


def _find_schedulers(optimizers: Mapping[int, Any], frame: Any) -> list[Any]:
    """The live LR schedulers whose optimizer's ``id`` is in ``optimizers``: first among
    the variables of the frames from ``frame`` out and their globals, and the attributes
    of those (``self.scheduler`` of a trainer: 0.35 ms here); else among every object
    the garbage collector tracks (one ``gc.get_objects()`` pass: 63 ms for 0.3M objects;
    it does not see those the GC scheduler froze, hence the frames first)."""
    from torch.optim.lr_scheduler import LRScheduler

    found: dict[int, Any] = {}

    def consider(obj: Any) -> None:
        if isinstance(obj, LRScheduler) and id(getattr(obj, "optimizer", None)) in optimizers:
            found.setdefault(id(obj), obj)

    spaces: dict[int, Mapping[str, Any]] = {}
    while frame is not None:
        spaces.setdefault(id(frame.f_globals), frame.f_globals)
        spaces[id(frame)] = where.frame_locals(frame)
        frame = frame.f_back
    # isinstance reads __class__, which some objects turn into a deprecation warning
    # (torch.distributed's reduce_op): not the user's to see. Set once: per object, it
    # made the pass over 0.3M objects 7x slower (66 -> 482 ms).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for space in spaces.values():
            for value in list(space.values()):
                consider(value)
                attrs = getattr(value, "__dict__", None)
                if isinstance(attrs, dict) and not isinstance(value, type):
                    for attr in list(attrs.values()):
                        consider(attr)
        if not found:
            for obj in gc.get_objects():
                consider(obj)
    return list(found.values())


# ------------------------------------------------------------------ an EMA of the model


def _shapes(module: nn.Module) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p.shape) for p in module.parameters())


def _sample(module: nn.Module) -> Tensor | None:
    """A few values of the first and last parameters, on the host: whether a copy of the
    model changed between the guard's start and its first step (an EMA's update), read
    once at each (``.data`` updates leave no trace in ``_version``)."""
    params = list(module.parameters())
    if not params:
        return None
    # A sharded copy's (DTensor) own shard: a global view would be a collective, and
    # this runs on rank 0 alone.
    local = [getattr(p, "_local_tensor", p) for p in (params[0], params[-1])]
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1)[:8].float().cpu() for p in local])


def _module_values(frame: Any) -> Iterator[tuple[str, str, nn.Module]]:
    """``(variable, site, module)`` of each ``nn.Module`` in the user's variables on the
    stack, and in their attributes (``self.ema`` of a trainer)."""
    for site, space in _user_spaces(frame):
        for name, value in list(space.items()):
            if isinstance(value, nn.Module):
                yield name, site, value
            elif not isinstance(value, type | ModuleType):
                attrs = getattr(value, "__dict__", None)
                if isinstance(attrs, dict):
                    for attr, inner in list(attrs.items()):
                        if isinstance(inner, nn.Module):
                            yield f"{name}.{attr}", site, inner


def _copies(guard: Guard, frame: Any) -> dict[int, tuple[nn.Module, str, str]]:
    """The modules on the stack that hold a copy of a guarded model (its parameters'
    shapes, in the module itself or in one it wraps: ``AveragedModel.module``) and are
    not passed to ``guard()``, nor part of a guarded model, nor a wrapper of one
    (``torch.compile``'s shares its parameters). By ``id``: ``(module, variable,
    site)``."""
    guarded: set[int] = set()
    params: set[int] = set()
    shapes = set()
    for m in guard.models.values():
        for w in model.wrappers(m):
            guarded |= {id(sub) for sub in w.modules()}
        params |= {id(p) for p in model.unwrap(m).parameters()}
        if s := _shapes(model.unwrap(m)):
            shapes.add(s)
    found: dict[int, tuple[nn.Module, str, str]] = {}
    for name, site, value in _module_values(frame):
        if id(value) in guarded or id(value) in found:
            continue
        first = next(value.parameters(), None)
        if first is None or id(first) in params:
            continue
        inner = [value, *value.children()]
        if any(_shapes(m) in shapes for m in inner):
            found[id(value)] = (value, name, site)
    return found


def _is_ema(module: nn.Module) -> bool:
    return isinstance(module, torch.optim.swa_utils.AveragedModel)


# ------------------------------------------------------------------ the checks


class Unsaved:
    """Owned by the checkpointer: what it saw at start (the unsaved generators' states,
    the model copies' values), and the check at the run's first step."""

    def __init__(self) -> None:
        self.checked = False
        self._start_step = 0
        self._generators: dict[int, tuple[torch.Generator, Tensor]] = {}
        self._copies: dict[int, Tensor | None] = {}

    def on_start(self, guard: Guard) -> None:
        """The unsaved generators on the stack and their states, the model copies and a
        few of their values: the first step tells which ones the loop changed."""
        self._start_step = guard.step
        if guard.rank != 0:
            return
        frame = sys._getframe(1)
        try:
            found = stack_generators(guard, frame)
            self._generators = {i: (gen, gen.get_state()) for i, (gen, _, _) in found.items()}
            self._copies = {i: _sample(m) for i, (m, _, _) in _copies(guard, frame).items()}
        except Exception as e:  # a diagnosis: an exotic object must not stop the start
            log.debug("guardrails: the loop's state not read at start: %r", e)

    def at_step(self, guard: Guard) -> None:
        """At the run's first step boundary (or its first save, if that comes first):
        each check once. A flag read per step after that."""
        if self.checked or guard.step <= self._start_step:
            return
        self.checked = True
        if guard.rank != 0:
            return
        frame = sys._getframe(1)
        for check in (self._schedulers, self._unsaved_generators, self._emas):
            try:
                check(guard, frame)
            except Exception as e:  # a diagnosis: an exotic object must not stop training
                log.debug("guardrails: %s failed: %r", check.__name__, e)
        try:
            guard.data_position.warn_epoch_loop_from_zero()
        except Exception as e:
            log.debug("guardrails: the epoch loop's check failed: %r", e)

    def _schedulers(self, guard: Guard, frame: Any) -> None:
        """An LR scheduler of a guarded optimizer that was not passed to
        ``guard(scheduler=...)`` is not in the checkpoint, so a resume would restart its
        schedule (another LR from the resumed step on). torch's schedulers mark the
        ``optimizer.step`` they wrap (``_wrapped_by_lr_sched``, kept by the guard's own
        wrapper), so a run without one costs an attribute read per optimizer; only for a
        marked optimizer that no passed scheduler drives is the scheduler looked for,
        and one found nowhere (built, then dropped) is not warned about."""
        passed = {id(getattr(s, "optimizer", None)) for s in guard.schedulers.values()}
        marked = {
            id(opt): name
            for name, opt in guard.optimizers.items()
            if getattr(opt.step, "_wrapped_by_lr_sched", False) and id(opt) not in passed
        }
        if not marked:
            return
        found = [
            (marked[id(s.optimizer)], type(s).__name__) for s in _find_schedulers(marked, frame)
        ]
        if not found:  # the scheduler is gone (a warmup built and dropped): nothing to keep
            return
        lone = len(guard.optimizers) == 1
        what = ", ".join(
            f"a {cls}" + ("" if lone else f" on optimizer {name!r}") for name, cls in found
        )
        guard.event(
            "scheduler_not_saved",
            level="warning",
            message=f"{what} drives the learning rate but was not passed to guard(), so "
            "checkpoints leave it out: a resumed run would restart its schedule and train "
            "with another learning rate from the resumed step on. Pass it: "
            "guard(..., scheduler=sched) (several: a list or a dict by name).",
            schedulers=[cls for _, cls in found],
        )

    def _unsaved_generators(self, guard: Guard, frame: Any) -> None:
        """A ``torch.Generator`` of the loop's own that no checkpoint saves and that was
        drawn from since the guard started: a resumed run would draw other batches or
        noise from it. Only those in a variable of the user's code on the stack at start
        and still now: one used only to build the data before the guard (its state
        unchanged) is not named, nor one made later (whether the loop draws from it
        cannot be told)."""
        if not self._generators:
            return
        start = self._generators
        unsaved = [
            (name, site)
            for i, (gen, name, site) in stack_generators(guard, frame).items()
            if i in start and not torch.equal(start[i][1], gen.get_state())
        ]
        if not unsaved:
            return
        names = ", ".join(f"`{name}` ({site})" for name, site in unsaved)
        fix = ", ".join(f'"{name}": {name}' for name, _ in unsaved)
        guard.event(
            "generator_not_saved",
            level="warning",
            message=f"the loop draws from torch.Generator {names}, which checkpoints "
            "leave out: a resumed run would draw other batches (or noise) from it than the "
            "run it continues. Pass it to be saved and set back at resume: guard(..., "
            f"generators={{{fix}}}).",
            generators=[name for name, _ in unsaved],
        )

    def _emas(self, guard: Guard, frame: Any) -> None:
        """An EMA of the model kept by the loop but not passed to ``guard()``: a copy of
        a guarded model (its parameters' shapes) that is a
        ``torch.optim.swa_utils.AveragedModel``, or that was on the stack at start and
        changed by the first step (a frozen copy, a distillation teacher, a DPO
        reference, does not: not named). A resumed run would restart the average."""
        named = []
        for i, (module, name, site) in _copies(guard, frame).items():
            if _is_ema(module):
                named.append((name, site, type(module).__name__))
            elif i in self._copies:
                before, now = self._copies[i], _sample(module)
                if before is not None and now is not None and not torch.equal(before, now):
                    named.append((name, site, type(module).__name__))
        if not named:
            return
        names = ", ".join(f"`{name}` ({cls}, {site})" for name, site, cls in named)
        extra = ", ".join(name for name, _, _ in named)
        what = "a copy" if len(named) == 1 else "copies"
        guard.event(
            "ema_not_saved",
            level="warning",
            message=f"the loop keeps {names}: {what} of the model that it updates (an "
            "EMA), not passed to guard(), so checkpoints leave it out: a resumed "
            "run would restart the average from the model's weights and end with other "
            f"EMA weights. Pass it beside the model: guard([model, {extra}], ...).",
            modules=[name for name, _, _ in named],
        )
