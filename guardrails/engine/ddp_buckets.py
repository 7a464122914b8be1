"""DDP's gradient buckets, saved with a checkpoint and given back on resume, so that a
DDP run resumed at any number of ranks continues bitwise (issue 50).

**Why.** ``DistributedDataParallel`` reduces gradients in buckets. At construction it
builds ONE bucket holding every gradient in parameter order
(``_BucketCapacityConfig.compute_bucket_size_limits``: ``[sys.maxsize]`` unless
``find_unused_parameters``), and after the first backward it rebuilds them
(``Reducer::rebuild_buckets``) into ``bucket_cap_mb`` pieces in the order the gradients
became ready. An uninterrupted run's step k+1 reduces the rebuilt buckets; a resumed
run's first step reduces the one bucket of construction. The all-reduce of a bucket
sums each element in an order set by its place in the bucket (gloo's ring: the chunk it
falls in), so the same gradients are summed in another order, and at more than 2 ranks
the float sums differ (at 2, ``a + b == b + a``). Measured on 4 gloo ranks, a resume at
step 3 of 6 against the uninterrupted run: 14 of 14 tensors differ; 13 of 14 with one
big bucket (``bucket_cap_mb=1000``: the rebuild still reorders it) and with
``static_graph=True``; none once the resumed run reduces the saved buckets
(``benchmarks/ddp_resume_bits.py``).

**What.** :func:`saved_layout` reads the buckets DDP reduces with (the parameter
indices of each, in DDP's reducer order) from DDP's own logging data
(``_get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]``, a few strings
copied), once per reducer: the writer asks between steps until it is known
(:func:`read_ahead`, from the boundary of step 1 to that of step 3, where DDP has logged
its rebuild), since the read takes the reducer's lock, which a loop stuck in DDP's
backward holds (its ``finalize_backward`` waits for the all-reduce under it): a
failure save from the watchdog's thread then finds it known, where reading it cost
that save a second and found nothing. Every save writes it in each rank's
``rankNNNNN.json`` (``ddp_buckets``). At resume, :func:`restore_everywhere` gives every
rank rank 0's, and :func:`restore_layout` gives DDP a fresh reducer whose buckets are
those, before its first step: DDP's own ``_ddp_init_helper`` run again (as DDP's
``__setstate__`` does to rebuild its reducer) with its bucket assignment replaced for
that one call by the saved one, then the comm hooks and ``static_graph`` of the old
reducer put on the new one. Nothing changes for an uninterrupted run: it never gets
here. The new reducer rebuilds after its first backward, as every reducer does, into
the same buckets (the same gradients become ready in the same order).

Both lean on DDP's private API (written against torch 2.13; its pieces are checked by
name and signature, not by version number); where this torch lacks one (:data:`_NEEDS`), or a
DDP uses what a second reducer would not carry over (a built-in comm hook, mixed
precision, the Python reducer, an optimizer in backward), nothing is done and one
debug line says why: the resume is then exactly what it was before.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from guardrails.distributed.store import wait_keys
from guardrails.engine.model import wrappers

logger = logging.getLogger("guardrails.checkpoint")

#: DDP's logging key holding the rebuilt buckets: ``"11 10 9 8, 7 6 5 4, 3 2 1 0"``.
_KEY = "rebuilt_per_bucket_param_indices"

#: What :func:`restore_layout` calls, with ``_ddp_init_helper``'s parameters by name
#: (checked by signature, so a torch that renamed or moved them is left alone).
_NEEDS = ("_ddp_init_helper", "_build_params_for_reducer", "_build_debug_param_to_name_mapping")
_HELPER_PARAMS = ["parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"]

#: The buckets each DDP module reduces with, once known, with the reducer that holds
#: them: a reducer rebuilds its buckets once, so they are read once (:func:`saved_layout`)
#: or known from the start (given by :func:`restore_layout`: until that reducer
#: rebuilds, DDP's logging data has no layout of its own, and a checkpoint written then
#: must still carry this one).
_known: weakref.WeakKeyDictionary[nn.Module, tuple[Any, list[list[int]]]] = (
    weakref.WeakKeyDictionary()
)

#: How long a thread other than the main one waits to read DDP's logging data. The read
#: takes the reducer's mutex, which a main thread stuck in DDP's backward holds (its
#: ``finalize_backward`` waits for the all-reduce under it): a failure save from the
#: watchdog's thread must not wait for it.
_READ_LIMIT_S = 1.0

#: How long a rank other than 0 waits for rank 0's word at a resume: rank 0 says it
#: after loading the same checkpoint as every rank (the barrier's limit, ``store.py``).
_WORD_LIMIT_S = 600.0


def find_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` among ``model``'s wrappers, if any."""
    ddp = nn.parallel.DistributedDataParallel
    return next((m for m in wrappers(model) if isinstance(m, ddp)), None)


def saved_layout(model: nn.Module) -> list[list[int]] | None:
    """The buckets the DDP in ``model`` reduces with, each a list of indices into its
    reducer's parameters; ``None`` when there is no DDP, it has not rebuilt its buckets
    yet (its first step has not finished: construction's buckets are what any resume
    starts with anyway), this torch does not say, or (from a thread other than the main
    one) the reducer is held by a stuck backward and nothing was read before."""
    ddp = find_ddp(model)
    if ddp is None:
        return None
    reducer = getattr(ddp, "reducer", None)
    known = _known.get(ddp)
    if known is not None and known[0] is reducer:
        return known[1]
    text = _read(ddp)
    layout = _parse(text) if text else None
    if layout is not None:
        _known[ddp] = (reducer, layout)
    return layout


def read_ahead(model: nn.Module) -> bool:
    """Read the buckets of the DDP in ``model`` now, on the loop's thread between steps,
    so that a save from another thread later (a failure save while the loop is stuck in
    DDP's backward, holding the lock the read takes) has them. Whether there is nothing
    left to read: no DDP, or its buckets are known."""
    return find_ddp(model) is None or saved_layout(model) is not None


def _read(ddp: nn.parallel.DistributedDataParallel) -> str | None:
    """DDP's logging data's layout string: on the main thread directly (it is between
    steps when it saves), elsewhere in a daemon thread given :data:`_READ_LIMIT_S`."""
    found: list[Any] = []

    def read() -> None:
        try:
            found.append(ddp._get_ddp_logging_data().get(_KEY))
        except (AttributeError, RuntimeError, AssertionError) as e:
            logger.debug("guardrails: DDP's bucket layout is not readable here: %r", e)

    if threading.current_thread() is threading.main_thread():
        read()
    else:
        reader = threading.Thread(target=read, name="guardrails-ddp-buckets", daemon=True)
        reader.start()
        reader.join(_READ_LIMIT_S)
        if not found:
            logger.debug("guardrails: DDP's bucket layout not read (its reducer is busy)")
    return found[0] if found else None


def _parse(text: str) -> list[list[int]] | None:
    """``"3 2, 1 0"`` -> ``[[3, 2], [1, 0]]``; ``None`` if it is not that."""
    try:
        return [[int(i) for i in bucket.split()] for bucket in text.split(",")]
    except ValueError:
        logger.debug("guardrails: DDP's bucket layout %r is not a list of indices", text)
        return None


def restore_everywhere(model: nn.Module, layout: Any, *, store: Any, rank: int, world: int) -> bool:
    """:func:`restore_layout` on every rank with rank 0's saved layout: each rank saved
    its own, the same (DDP's rebuild broadcasts rank 0's), but a rank whose save could
    not read it has none, and ranks reducing in different buckets would all-reduce
    buffers of different sizes. Rank 0 applies its layout and says which it applied
    (``None``: none) under the key ``ddp-buckets`` of ``store`` (``None``: a single
    process); the others wait for its word and apply that. Nothing when there is no DDP."""
    if find_ddp(model) is None:
        return False
    if store is None:
        return restore_layout(model, layout)
    if rank == 0:
        applied = restore_layout(model, layout)
        store.set("ddp-buckets", json.dumps(layout if applied else None))
        return applied
    # Rank 0 says it right after its own load: long for a big model, hence the limit.
    wait_keys(store, ["ddp-buckets"], timedelta(seconds=_WORD_LIMIT_S), world=world)
    return restore_layout(model, json.loads(store.get("ddp-buckets")))


def restore_layout(model: nn.Module, layout: Any) -> bool:
    """Give the DDP in ``model`` a fresh reducer whose buckets are ``layout`` (what
    :func:`saved_layout` returned in the run that saved), before its first step.
    ``True`` when its buckets are now ``layout``; ``False`` (and one debug line) when
    there is nothing to do or it cannot be done here."""
    ddp = find_ddp(model)
    if ddp is None or layout is None:
        return False
    why = _cannot(ddp, layout)
    if why is not None:
        logger.debug(
            "guardrails: DDP's buckets not restored (%s); a resume at more than 2 ranks "
            "may then differ from an uninterrupted run in the last bits",
            why,
        )
        return False
    if saved_layout(ddp) == layout:
        return True  # already reducing with these (a reducer that rebuilt the same)
    old_reducer, old_logger = ddp.reducer, ddp.logger
    try:
        _rebuild_reducer(ddp, layout)
    except Exception as e:  # DDP's private API: the old reducer stays
        new = ddp.reducer
        ddp.reducer, ddp.logger = old_reducer, old_logger
        if new is not old_reducer:
            new._remove_autograd_hooks()
        logger.warning("guardrails: DDP's buckets could not be restored (%r); this resume "
                       "may differ from an uninterrupted run in the last bits", e)  # fmt: skip
        return False
    old_reducer._remove_autograd_hooks()  # the new reducer's hooks alone reduce now
    _known[ddp] = (ddp.reducer, layout)
    logger.debug("guardrails: DDP resumed with its saved buckets: %s", layout)
    return True


def _cannot(ddp: nn.parallel.DistributedDataParallel, layout: Any) -> str | None:
    """Why ``layout`` cannot be given to ``ddp`` here (``None``: it can)."""
    missing = [name for name in _NEEDS if not hasattr(ddp, name)]
    if missing or not hasattr(dist, "_compute_bucket_assignment_by_size"):
        return f"this torch has no {', '.join(missing) or '_compute_bucket_assignment_by_size'}"
    if list(inspect.signature(ddp._ddp_init_helper).parameters) != _HELPER_PARAMS:
        return "this torch's DistributedDataParallel._ddp_init_helper takes other arguments"
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_remove_autograd_hooks"):
        return "this DDP has no C++ reducer to replace"
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "mixed_precision", None):
        return "the Python reducer or DDP's mixed precision"
    if getattr(ddp, "_delay_all_reduce_all_params", False) or any(
        hasattr(p, "_in_backward_optimizers") for p in ddp.module.parameters()
    ):
        return "an optimizer in backward, or parameters all-reduced outside the reducer"
    if ddp._get_ddp_logging_data().get("comm_hook") and not getattr(ddp, "_comm_hooks", None):
        return "a built-in comm hook, which a new reducer would not carry over"
    count = len(ddp._build_params_for_reducer()[0])
    flat = sorted(i for bucket in layout for i in bucket) if _is_layout(layout) else None
    if flat != list(range(count)):
        return f"the saved layout does not cover this DDP's {count} parameters once each"
    return None


def _is_layout(layout: Any) -> bool:
    return isinstance(layout, list) and all(
        isinstance(b, list) and b and all(type(i) is int for i in b) for b in layout
    )


def _rebuild_reducer(ddp: nn.parallel.DistributedDataParallel, layout: list[list[int]]) -> None:
    """DDP's ``_ddp_init_helper`` again, its bucket assignment ``layout``; then what
    ``__init__`` and ``register_comm_hook`` put on the old reducer, on the new one."""
    params, sparse = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(params)
    assign = dist._compute_bucket_assignment_by_size

    def saved(*args: Any, **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        # The helper hands the reducer the assignment reversed (it assumes parameter
        # order, reduced last to first): reversed here, the reducer gets ``layout``.
        # The size limits only label the buckets in DDP's logging.
        return [list(b) for b in reversed(layout)], [sys.maxsize] * len(layout)

    dist._compute_bucket_assignment_by_size = saved
    try:
        ddp._ddp_init_helper(params, sparse, names, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = assign
    if ddp.static_graph:  # as DDP's __setstate__ does after the same helper
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, state in getattr(ddp, "_comm_hooks", []):
        ddp.logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(ddp.reducer, state, hook)
