"""The data position: where in the loader a checkpoint was taken, and how a resumed run
continues from exactly there.

A resumed run that "sees different data" lost the position in one of two ways: it
restarts the epoch (repeating samples) or it reshuffles (a different order). A position
here is ``(epoch, batch_in_epoch)`` plus what is needed to reproduce the pass's order,
and a resumed run continues it in one of three ways, the best the loader allows:

1. ``state_dict``: the loader has ``state_dict()`` / ``load_state_dict()`` (torchdata's
   ``StatefulDataLoader``, or your own): its state is saved and loaded; exact.
2. ``replay``: a ``torch.utils.data.DataLoader`` over a map-style dataset. The pass's
   shuffle is a function of the RNG state when the pass began (``RandomSampler`` draws
   its seed from torch's default generator or its own ``generator``), so the guard
   keeps those states from just before each ``iter(loader)`` (a ~5 KB copy per pass)
   and, on resume, replays the pass's *indices* with them, drops the consumed batches
   and loads only the rest: no sample is loaded twice. Exact for the order and for the
   main process's RNG; with ``num_workers > 0`` the workers get the same base seed but
   each remaining batch may land on a different worker than in the first run, so
   random augmentations *inside* workers can differ.
3. ``fast_forward``: any other iterable (a list, a generator, an ``IterableDataset``):
   the consumed batches are fetched again and dropped, with a warning event that says
   how long it took and how to avoid it.

A loop that fetches the next batch before ``optimizer.step()`` (a prefetch) holds a
batch past the trained position at a checkpoint. With ``state_dict`` and
``fast_forward`` that batch is saved with the checkpoint and handed out first on
resume, not fetched again: a loader that draws from the global RNG (nanoGPT's
``get_batch``: ``torch.randint``) drew it before the checkpoint's RNG state, so a fetch
on resume, from the state after that draw, would give another batch.
"""

from __future__ import annotations

import ast
import copy
import itertools
import linecache
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from guardrails.distributed import dist
from guardrails.engine import where

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.data")


def stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _generators(loader: Any) -> dict[str, torch.Generator]:
    """The torch generators a pass over ``loader`` draws from, besides the default one."""
    gens: dict[str, torch.Generator] = {}
    owners = (("loader_generator", dist.inner(loader)), ("sampler_generator", _sampler(loader)))
    for name, owner in owners:
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in gens.values()):
            gens[name] = g
    return gens


def loader_generators(loader: Any) -> dict[str, torch.Generator]:
    """The loader's and sampler's own generators, which every checkpoint saves."""
    return _generators(loader)


def _sampler(loader: Any) -> Any:
    """The sampler that draws a pass's indices: the one the loader's batch sampler reads
    (``DataLoader(batch_sampler=BatchSampler(RandomSampler(...)))`` leaves
    ``loader.sampler`` an unused SequentialSampler; accelerate's BatchSamplerShard
    wraps the user's BatchSampler), else ``loader.sampler``. Under accelerate's
    prepared loader, the DataLoader it iterates (``dist.inner``)."""
    loader = dist.inner(loader)
    if not isinstance(loader, DataLoader):
        return None
    batches = loader.batch_sampler
    for _ in range(4):
        if hasattr(batches, "sampler"):
            return batches.sampler
        batches = getattr(batches, "batch_sampler", None)
    return loader.sampler


def epoch_start(loader: Any) -> dict[str, Tensor]:
    """RNG states a pass's shuffle draws from, taken just before ``iter(loader)``."""
    states = {"torch": torch.get_rng_state()}
    for name, g in _generators(loader).items():
        states[name] = g.get_state()
    return states


def _set_states(loader: Any, states: dict[str, Tensor]) -> None:
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    for name, g in _generators(loader).items():
        if name in states:
            g.set_state(states[name])


class DataPosition:
    """Where the loop is in its loader, as a checkpoint saves it and a resume continues
    it: the batches fetched and trained, the pass's epoch-start RNG states, a pending
    drop, a resumed pass still to continue, and what the loop's epoch counter showed.
    One per guard, owned by it; it reads the guard's published fields (``epoch``,
    ``batch_in_epoch``, ``exhausted_at``) and writes none: the guard sets them from
    what :meth:`begin_pass` and :meth:`load` return.

    The guard's per-fetch and per-forward bookkeeping updates the four public fields
    inline (a method call would be a Python frame per batch); the rest is methods."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        #: Batches fetched through the guard, all passes.
        self.n_fetched = 0
        #: Batches fetched since the last training forward (the next step's, in a loop
        #: that prefetches).
        self.fetched: list[Any] = []
        #: The position at the last training forward: ``(epoch, batch_in_epoch,
        #: epoch-start RNG states)``. What a checkpoint saves (:meth:`trained`).
        self.trained_at: tuple[int, int, dict[str, Any] | None] | None = None
        #: RNG states just before the current pass's ``iter(loader)``, so a resumed run
        #: can replay the pass's shuffle (the module docstring); ``None`` until a pass.
        self.epoch_start: dict[str, Any] | None = None
        #: Batches still to be fetched and dropped (``Guard.drop_batches``: a rewind
        #: skips past a divergence's): counted in the position, never trained on.
        self.drop = 0
        # Set by a resume: the position the first pass continues from.
        self._resumed: dict[str, Any] | None = None
        # Why the loader's state_dict() could not be saved, once it failed (reported
        # once; later saves keep the position as a count, see _own_state).
        self._loader_state_error: str | None = None
        # The loop's own int variables that equalled the epoch at every pass start
        # (its epoch counter), whether a pass past epoch 0 proved it, and, after a
        # resume, the ones to check at the first pass (note_pass).
        self._epoch_names: set[str] | None = None
        self._epoch_proven = False
        self._epoch_check: set[str] | None = None
        # Where the loop iterates the guard (file, line) and whether its epoch loop was
        # told at a resumed pass: the first step reads the loop's source (unsaved.py).
        self._loop_site: tuple[str, int] | None = None
        self._epoch_told = False

    def begin_pass(self, loader: Any) -> tuple[Iterator[Any], int | None]:
        """At a pass's first ``next()``: the pass's iterator, and the batch it continues
        from when it is a resumed pass (``None``: a new pass, from its first batch)."""
        position, self._resumed = self._resumed, None
        if position is None:
            self.epoch_start = epoch_start(loader)
            return iter(loader), None
        it, self.epoch_start = self._resume_iter(loader, position)
        return it, int(position["batch_in_epoch"])

    @property
    def resuming(self) -> bool:
        """Whether the next pass continues a resumed one (set by :meth:`load`)."""
        return self._resumed is not None

    def trained(self, at: Any = None) -> tuple[int, int, dict[str, Tensor] | None]:
        """``(epoch, batch_in_epoch, epoch-start RNG states)`` after the batches the
        completed steps trained on: the position at the last step's last training forward
        (:attr:`trained_at`), not the batches fetched, which in a loop that prefetches
        are one more. A position at the very end of a pass whose next pass has started
        (the prefetched batch was that pass's first) is the next pass's start. Resumed and
        not iterated yet: the resumed position (a save right after a resume, such as
        ``g.save_checkpoint()`` before the loop, wrote batch 0 of the pass, and the next
        resume trained the pass's first batches again). ``at``: another ``trained_at``
        (the one of the last step boundary, for a failure save)."""
        trained_at = self.trained_at if at is None else at
        resumed = self._resumed
        if trained_at is None and resumed is not None:
            start = resumed.get("epoch_start") or None
            return int(resumed["epoch"]), int(resumed["batch_in_epoch"]), start
        guard = self._guard
        epoch, batch, start = trained_at or (
            guard.epoch,
            guard.batch_in_epoch,
            self.epoch_start,
        )
        if epoch < guard.epoch and guard.exhausted_at in (None, (epoch, batch)):
            return guard.epoch, 0, self.epoch_start
        return epoch, batch, start

    def note_pass(self, frame: Any) -> None:
        """At each ``iter(guard)``: which of the loop's own int variables count the passes
        (equal to the pass's epoch at every pass so far: ``epoch`` in ``for epoch in
        range(...): for batch in g``), and, at a resumed run's first pass, whether one the
        run had counted with starts again from another number.

        A loop ``for epoch in range(3)`` resumed in epoch 1 makes three passes after the
        resumed one begins, not two: it trains epochs 1, 2 and 3 (one more than the run it
        continues). The guard cannot tell where such a loop ends, only that its counter
        no longer says what it said in the first process (``frame``: the loop's, which
        called ``iter``). Once per pass: a scan of the frame's variables (a few µs)."""
        guard = self._guard
        if self._resumed is not None:
            epoch = guard.epoch  # the resumed pass (the guard set it from load())
        else:
            epoch = guard.epoch + (1 if guard.batch_in_epoch else 0)  # as _batches counts it
        if self._loop_site is None:
            self._loop_site = (frame.f_code.co_filename, frame.f_lineno)
        try:
            ints = {k: v for k, v in where.frame_locals(frame).items() if type(v) is int}
        except Exception:  # an exotic frame: nothing to learn from it
            ints = {}
        if self._epoch_check is not None:
            carried, self._epoch_check = self._epoch_check, None
            restarted = sorted(n for n in carried if n in ints and ints[n] != epoch)
            if restarted:
                self._epoch_told = True
                name = restarted[0]
                off = epoch - ints[name]
                more = f"{off} pass(es) more" if off > 0 else f"{-off} pass(es) fewer"
                guard.event(
                    "epoch_loop_restarted",
                    level="warning",
                    message=f"resumed in epoch {epoch} (step {guard.step}), but your loop's "
                    f"`{name}` is {ints[name]} at the resumed pass, where the run it continues "
                    f"had it equal to the epoch: a loop `for {name} in range(n_epochs)` now "
                    f"makes {more} than the run asks for (other final weights). Count from "
                    "the guard's epoch: "
                    f"`for {name} in range(g.epoch, n_epochs):` (or `while g.epoch < "
                    "n_epochs: for batch in g:`).",
                    variable=name,
                    value=ints[name],
                    epoch=epoch,
                )
        same = {n for n, v in ints.items() if v == epoch}
        self._epoch_names = same if self._epoch_names is None else self._epoch_names & same
        # Pass 0 alone proves nothing (every int that is 0 equals it).
        self._epoch_proven = self._epoch_proven or epoch >= 1

    def warn_epoch_loop_from_zero(self) -> None:
        """At the run's first step (the checkpointer's ``unsaved``): the loop's epoch loop
        around ``for batch in g`` counts from 0 (``for epoch in range(n_epochs)``), so a
        resumed run would make the passes it had made again. Read once from the loop's
        source, where ``iter(g)`` was called (``note_pass``); not when this run already said
        it at its resumed pass (``epoch_loop_restarted``, which says how many passes more)."""
        site = self._loop_site
        if site is None or self._epoch_told:
            return
        filename, lineno = site
        found = _epoch_loop(filename, lineno)
        if found is None:
            return
        clause, line = found
        name = clause.split(" in ", 1)[0].removeprefix("for ")
        self._guard.event(
            "epoch_loop_from_zero",
            level="warning",
            message=f"your epoch loop `{clause}:` ({Path(filename).name}:{line}) counts from "
            "0: a run resumed in epoch k would make all its passes again after the resumed "
            "one, more than the run asks for (other final weights). Count from the guard's "
            f"epoch: `for {name} in range(g.epoch, n_epochs):` (or `while g.epoch < "
            "n_epochs: for batch in g:`).",
            variable=name,
            line=line,
        )

    def save(
        self, *, boundary: tuple[Any, list[Any]] | None = None, refetch_from: int | None = None
    ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """``(position, tensors)`` of the guard's loader at a step boundary: the JSON part
        (with the loader's own ``state_dict()`` when it has one that works) and its
        tensors: the epoch-start RNG states under ``epoch_start.*``, the loader's and
        sampler's own generators as they are now under ``current.*`` (the next pass draws
        from them). ``boundary``: ``(trained_at, batches fetched since)`` of the last step
        boundary, when the loop has moved past it (a failure save inside a step): the
        batches that step fetched are handed out first on resume, as a prefetch's are;
        ``refetch_from``: those from this index on were fetched after the RNG streams
        saved with them, and a fast-forwarded loader fetches them again instead (from
        those streams: the same batches, and the draws they made)."""
        loader = self._guard.loader
        own = self._own_state(loader, held=None if boundary is None else boundary[1])
        if own is not None:
            kind = "state_dict"
        elif _replayable(loader):
            kind = "replay"
        else:
            kind = "fast_forward"
        epoch, batch, start = self.trained(None if boundary is None else boundary[0])
        held = self._held() if boundary is None else boundary[1]
        if kind == "fast_forward" and refetch_from is not None:
            held = held[:refetch_from]
        position: dict[str, Any] = {
            "kind": kind,
            "epoch": epoch,
            "batch_in_epoch": batch,
            "sampler_epoch": getattr(_sampler(loader), "epoch", None),
        }
        if self._epoch_proven and self._epoch_names:
            position["epoch_names"] = sorted(self._epoch_names)
        if self.drop:  # batches a rewind still drops before the next one trained on
            position["drop"] = self.drop
        tensors = {f"epoch_start.{k}": v for k, v in (start or {}).items()}
        for name, g in _generators(loader).items():
            tensors[f"current.{name}"] = g.get_state()
        if own is not None:
            position.update(own[0])
            tensors.update(own[1])
        elif kind == "fast_forward" and held and _plain(held):
            # Fetching it again would draw it afresh (see the module docstring); a batch
            # that would not come back as the same types is fetched again.
            position.update(_encode_held(held, tensors))
        return position, tensors

    def _held(self) -> list[Any]:
        """The batches fetched past the trained position: a prefetching loop's next batch.
        Resumed and not iterated yet: the resumed position's, still to be handed out."""
        resumed = self._resumed
        if self.trained_at is None and resumed is not None:
            return list(resumed.get("held") or [])
        return list(self.fetched)

    def _own_state(
        self, loader: Any, *, held: list[Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Tensor]] | None:
        """The loader's own ``state_dict()`` and the batches fetched past the trained
        position, encoded (``(position entries, tensors)``); ``None`` when the loader has no
        ``state_dict()``, or when it raised or cannot be stored: then the position is kept
        as a count of batches (replay or fast-forward), with one warning, and this guard
        does not call it again. A save never fails on the data position."""
        from guardrails.checkpoint.codec import encode

        if not stateful(loader) or self._loader_state_error is not None:
            return None
        tensors: dict[str, Tensor] = {}
        try:
            entries = {
                "loader": encode(loader.state_dict(), "loader", tensors),
                # The loader's own state is past the batches a prefetching loop fetched for
                # the next step; they are saved and handed out first on resume (no rewind).
                **_encode_held(self._held() if held is None else held, tensors),
            }
        except Exception as exc:  # the user's / a library's loader: any failure, same fallback
            self._loader_state_error = f"{type(exc).__name__}: {exc}"
            name = type(loader).__name__  # type(): accelerate's loaders claim DataLoader
            how = (
                "replays the pass's order and loads only the batches not trained on yet"
                if _replayable(loader)
                else "fetches and drops the batches already trained on in the interrupted "
                "pass (the same order; each one is loaded again)"
            )
            self._guard.event(
                "loader_state_unavailable",
                level="warning",
                message=f"{name}.state_dict() failed ({self._loader_state_error}), so "
                f"checkpoints keep this loader's position as a count of batches: a resumed "
                f"run {how}. Nothing to do unless that is too slow; a loader whose "
                "state_dict() / load_state_dict() work resumes from its own state.",
                loader=name,
                error=self._loader_state_error,
                resume="replay" if _replayable(loader) else "fast_forward",
            )
            return None
        return entries, tensors

    def load(self, position: dict[str, Any], tensors: dict[str, Tensor]) -> int:
        """Make the next pass continue ``position`` (called at resume); returns
        the epoch it is in, which the guard publishes."""
        from guardrails.checkpoint.codec import decode

        position = dict(position)
        position["epoch_start"] = {
            k.removeprefix("epoch_start."): v
            for k, v in tensors.items()
            if k.startswith("epoch_start.")
        }
        guard = self._guard
        loader = guard.loader
        if position.get("loader") is not None and stateful(loader):
            loader.load_state_dict(decode(position["loader"], tensors))  # type: ignore[union-attr]
        # Fresh copies: a tensor read from the checkpoint's file may sit at an alignment
        # that sends CPU matmuls down another kernel (last-bit differences, measured).
        # Held batches go back to the device they were fetched to.
        devices = position.get("held_devices") or {}
        position["held"] = decode(
            position.get("held") or [],
            {
                k: _to(v, devices[k], guard.device) if k in devices else v.clone()
                for k, v in tensors.items()
            },
        )
        # The generators a DataLoader / sampler owns are not among the RNG streams a
        # checkpoint restores: without this, a resumed run's next pass would draw from a
        # freshly seeded generator and repeat the first pass's order.
        for name, g in _generators(loader).items():
            if f"current.{name}" in tensors:
                g.set_state(tensors[f"current.{name}"])
        self.drop = int(position.get("drop") or 0)
        self._resumed = position
        names = position.get("epoch_names") or []
        if names:  # the loop's pass counters in the run this one continues (note_pass)
            self._epoch_names, self._epoch_proven = set(names), True
            self._epoch_check = set(names)
        return int(position["epoch"])

    def _resume_iter(self, loader: Any, position: dict[str, Any]) -> tuple[Any, Any]:
        """An iterator over the rest of the interrupted pass, and that pass's epoch-start
        RNG states (kept for the next checkpoint)."""
        skip = int(position["batch_in_epoch"])
        start = position.get("epoch_start") or None
        saved_epoch = position.get("sampler_epoch")
        live_epoch = getattr(_sampler(loader), "epoch", None)
        if saved_epoch is not None and live_epoch != saved_epoch:
            self._guard.event(
                "data_epoch_mismatch",
                level="warning",
                message=f"the sampler is at epoch {live_epoch} but the checkpoint was taken in "
                f"epoch {saved_epoch}: the resumed pass shuffles differently from the first run. "
                "Call sampler.set_epoch() with the epoch counted from g.epoch "
                "(for epoch in range(g.epoch, n_epochs): ...).",
            )
        if position["kind"] == "state_dict" and stateful(loader):
            # The loader's own state was loaded at resume; the batches fetched beyond the
            # trained position come first.
            return itertools.chain(position.get("held") or [], iter(loader)), start
        if position["kind"] == "replay" and _replayable(loader) and start is not None:
            return _replay(loader, skip, start), start
        held = position.get("held") or []
        if position["kind"] == "fast_forward" and held:
            # Past the held batches too, which are handed out as saved.
            it = _fast_forward(loader, skip + len(held), start, self._guard, trained=skip)
            return itertools.chain(held, it), start
        return _fast_forward(loader, skip, start, self._guard), start


def tokens_in(batch: Any) -> int | None:
    """Tokens in a batch: the size of its first tensor when that is an integer
    ``(batch, seq)`` tensor of token ids; ``None`` otherwise. Shapes only, no sync."""
    first = batch
    while isinstance(first, (tuple, list)) and first:
        first = first[0]
    # A tensor first: the Mapping check is an ABC's (~0.3-1 us a batch).
    if not isinstance(first, Tensor) and isinstance(first, Mapping):
        first = first.get("input_ids")
    if isinstance(first, Tensor) and first.ndim == 2 and not first.is_floating_point():
        return first.numel()
    return None


def _epoch_loop(filename: str, lineno: int) -> tuple[str, int] | None:
    """``(its for clause, line)`` of the epoch loop around the ``for batch in g`` at
    ``lineno`` of ``filename`` when it counts from 0 (``for epoch in range(n)``,
    ``range(0, n)``): a resumed run makes its passes again. ``None`` when the source
    cannot be read, the nearest enclosing loop is a ``while`` (or none, or the guard is
    built inside it), or the range counts from the guard's epoch (:func:`_counts_from_zero`).
    One parse of the file, once a run."""
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return None
    parents: dict[int, ast.AST] = {}
    target = None
    for node in ast.walk(tree):  # outer nodes first: the last match is the innermost
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
        if isinstance(node, ast.For) and node.lineno <= lineno <= (node.iter.end_lineno or 0):
            target = node
    scopes = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
    node = parents.get(id(target)) if target is not None else None
    while node is not None and not isinstance(node, scopes | ast.While | ast.With | ast.AsyncWith):
        if isinstance(node, ast.For) and _is_range(node.iter):
            scope = node
            while scope is not None and not isinstance(scope, scopes | ast.Module):
                scope = parents.get(id(scope))
            if not _counts_from_zero(node, scope or tree):
                return None  # a range that counts from the guard's epoch
            return f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}", node.lineno
        node = parents.get(id(node))
    return None


def _is_range(it: ast.expr) -> bool:
    return isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"


def _reads_epoch(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "epoch" for n in ast.walk(node))


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _counts_from_zero(loop: ast.For, scope: ast.AST) -> bool:
    """Whether ``loop`` (``for ... in range(...)``) counts its passes from 0 on every
    run. Not when: the range starts elsewhere (``range(g.epoch, n)``, ``range(start,
    n)``), reads an ``.epoch`` (``range(n - g.epoch)``) or a variable its function
    assigns from one (``left = n - g.epoch``), or the loop tests an ``.epoch`` or skips
    on its own counter (``if g.epoch >= n: break``, ``if epoch < start: continue``)."""
    it = loop.iter
    if not isinstance(it, ast.Call) or _reads_epoch(it):
        return False
    if len(it.args) >= 2 and not (isinstance(it.args[0], ast.Constant) and it.args[0].value == 0):
        return False
    read = _names(it)
    for n in ast.walk(scope):
        if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if read & set().union(*map(_names, targets)) and _reads_epoch(n.value):
                return False
    counter = _names(loop.target)
    for n in ast.walk(loop):
        if isinstance(n, ast.If | ast.While | ast.IfExp) and _reads_epoch(n.test):
            return False
        if (
            isinstance(n, ast.If)
            and counter & _names(n.test)
            and any(isinstance(b, ast.Continue | ast.Break) for b in n.body)
        ):
            return False
    return True


def _plain(obj: Any) -> bool:
    """Whether ``obj`` comes back from a checkpoint as the same types: tensors, numbers,
    strings, and exactly tuple / list / dict (str keys) of them. A subclass (a
    NamedTuple, transformers' BatchEncoding) would come back as its base."""
    if obj is None or type(obj) in (bool, int, float, str, Tensor):
        return True
    if type(obj) in (tuple, list):
        return all(map(_plain, obj))
    if type(obj) is dict:
        return all(type(k) is str and _plain(v) for k, v in obj.items())
    return False


def _encode_held(held: list[Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    """Position entries for ``held``: the batches, and the device of each tensor not on
    the CPU (a checkpoint's tensors load on the CPU; nanoGPT's batches are on the GPU)."""
    from guardrails.checkpoint.codec import encode

    mine: dict[str, Tensor] = {}
    entries = {"held": encode(held, "held", mine)}
    devices = {k: str(t.device) for k, t in mine.items() if t.device.type != "cpu"}
    if devices:
        entries["held_devices"] = devices
    tensors.update(mine)
    return entries


def check_position(loader: Any, position: dict[str, Any] | None, file: Path) -> None:
    """Before a resume applies anything: the saved position is one this run's loader
    can reach. A position past the end of a pass (a checkpoint saved with another
    batch size or dataset, or an edited file) would otherwise be fast-forwarded batch by
    batch: 10**12 batches never end. The position's types were checked with the file
    (:func:`guardrails.checkpoint.schema.check_rank_state`); here, its size, where the loader
    has a length. A loader with its own state (``state_dict``) keeps its own position;
    one without a length is bounded as it is fast-forwarded (:func:`_fast_forward`)."""
    from guardrails._errors import ResumeError

    if position is None or loader is None or position.get("kind") == "state_dict":
        return
    try:
        per_epoch = len(loader)
    except (TypeError, NotImplementedError):  # an iterable without a length
        return
    at = int(position["batch_in_epoch"])
    if at > per_epoch:
        raise ResumeError(
            f"{file}: the checkpoint's data position (field data.batch_in_epoch) is {at} "
            f"batches into epoch {position['epoch']}, more than this run's loader yields "
            f"per epoch ({per_epoch}): it was saved with another loader (batch size, "
            "dataset, number of ranks), or the file was changed",
            path=str(file),
            field="data.batch_in_epoch",
            hint="resume with the loader the checkpoint was saved with; or resume from an "
            "older step_* directory (guard(..., resume=...)); or start fresh with "
            "resume=None (or a new run_dir). Nothing was modified.",
        )


def _to(tensor: Tensor, device: str, fallback: torch.device) -> Tensor:
    """``tensor`` on the device it was saved from; on ``fallback`` (the guard's device)
    where that one is not here (saved on a GPU, resumed on another machine or on the
    CPU)."""
    try:
        return tensor.to(device)
    except (RuntimeError, AssertionError, ValueError):  # no such device / CUDA build
        return tensor.to(fallback)


def _replayable(loader: Any) -> bool:
    # Not a wrapper such as accelerate's prepared loader (which claims DataLoader as its
    # __class__): its own __iter__ places batches on the device and syncs the shuffle
    # across ranks, and ignores a batch_sampler set on a copy, so it is fast-forwarded.
    return (
        dist.inner(loader) is loader
        and isinstance(loader, DataLoader)
        and loader.batch_sampler is not None
        and not isinstance(loader.dataset, IterableDataset)
    )


def _replay(loader: DataLoader, skip: int, start: dict[str, Tensor]) -> Any:
    now = epoch_start(loader)  # the checkpoint's states, restored by the resume
    _set_states(loader, start)
    # The order of draws in the first run: DataLoader's iterator takes the workers'
    # base seed first (one int64 from loader.generator or the default generator,
    # torch/utils/data/dataloader.py, _BaseDataLoaderIter.__init__), then the sampler
    # draws its shuffle seed lazily, at the first index. Replay both, in that order.
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    rest = list(itertools.islice(iter(loader.batch_sampler), skip, None))
    # Where the loader's own generators stand once the pass is over: RandomSampler
    # draws once more as its iterator runs out (its trailing randperm for the
    # remainder, torch/utils/data/sampler.py), so the next pass starts from there.
    end = {name: g.get_state() for name, g in _generators(loader).items()}
    _set_states(loader, start)
    clone = copy.copy(loader)
    # DataLoader refuses to set batch_sampler after __init__ (it guards the attribute);
    # the clone is private to this pass, so set it underneath.
    object.__setattr__(clone, "batch_sampler", rest)
    object.__setattr__(clone, "_iterator", None)
    it = iter(clone)  # draws the same base seed as the first run: same worker seeds
    _set_states(loader, now)
    return _then(it, lambda: _set_states(loader, end))


def _then(it: Any, done: Any) -> Any:
    """``it``'s items, then ``done()`` once it is exhausted."""
    yield from it
    done()


#: A fast-forward still going after this long says how far it is, again at each such
#: interval: the run's start is blocked meanwhile (a streaming dataset fetching hours
#: of batches, or a position that is not this loader's), and the estimate says which.
PROGRESS_EVERY_S = 60.0


def _drop(it: Any, n: int, loader: Any, guard: Guard, t0: float) -> int:
    """Fetch and drop up to ``n`` batches of ``it``; the number fetched."""
    fetched, note_at = 0, t0 + PROGRESS_EVERY_S
    clock = time.perf_counter
    for _ in itertools.islice(it, n):
        fetched += 1
        now = clock()  # ~50 ns, against a batch's fetch
        if now >= note_at:
            note_at = now + PROGRESS_EVERY_S
            rate = fetched / (now - t0)
            guard.event(
                "data_fast_forward_progress",
                level="warning",
                message=f"resuming: fetching and dropping the batches already trained on, "
                f"{fetched:,} of {n:,} after {now - t0:.0f} s ({rate:,.1f} batches/s, "
                f"about {_duration((n - fetched) / rate)} left). A position far beyond "
                f"what this {type(loader).__name__} yields means the checkpoint is not "
                "this run's: stop and resume=None, or resume= another step_* directory.",
                batches=fetched,
                of=n,
            )
    return fetched


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.0f} s"


def _fast_forward(
    loader: Any,
    skip: int,
    start: dict[str, Tensor] | None,
    guard: Guard,
    *,
    trained: int | None = None,
) -> Any:
    """``loader``'s pass from ``start``, ``skip`` batches in (``trained`` of them trained
    on, the rest held by the checkpoint), with the RNG states left as they are now."""
    now = epoch_start(loader)
    if start is not None:
        _set_states(loader, start)
    t0 = time.perf_counter()
    it = iter(loader)
    fetched = _drop(it, skip, loader, guard, t0)
    _set_states(loader, now)
    trained = skip if trained is None else trained
    if fetched < trained:
        # A loader without a length ran out before the saved position (one with a
        # length was checked before the resume applied anything: check_position).
        from guardrails._errors import ResumeError

        raise ResumeError(
            f"the checkpoint's data position is {trained} batches into the pass, but this "
            f"run's loader ({type(loader).__name__}) was exhausted after {fetched}: it was "
            "saved with another loader (batch size, dataset, number of ranks), or the "
            "checkpoint was changed",
            step=guard.step,
            field="data.batch_in_epoch",
            hint="resume with the loader the checkpoint was saved with; or resume from an "
            "older step_* directory (guard(..., resume=...)); or start fresh with "
            "resume=None (or a new run_dir).",
        )
    fetched = min(fetched, trained)  # the held ones are not announced as dropped
    if trained:
        # A library's wrapper of a DataLoader (accelerate's prepared loader) runs its own
        # iteration (device placement, the ranks' shuffle sync): it is not replayed.
        how = (
            "wraps a DataLoader and iterates it itself"
            if dist.inner(loader) is not loader
            else "cannot skip without loading. A DataLoader over a map-style dataset, or a "
            "loader with state_dict()/load_state_dict() (torchdata's StatefulDataLoader), "
            "resumes without loading them"
        )
        took = time.perf_counter() - t0
        guard.event(
            "data_fast_forward",
            # A warning once it costs the restart a minute (PROGRESS_EVERY_S), worth a
            # loader that can skip; under that, information: nanoGPT's and nanochat's
            # resumes fetch their 94-120 batches again in 0.1-0.2 s, every time.
            level="warning" if took >= PROGRESS_EVERY_S else "info",
            message=f"resumed mid-pass by fetching and dropping the {fetched} batches "
            f"already trained on ({took:.1f} s): a {type(loader).__name__} {how}.",
            batches=fetched,
            seconds=round(took, 3),
        )
    return it
