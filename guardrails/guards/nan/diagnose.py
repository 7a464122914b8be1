"""Why did this step go non-finite? The usual triage, cheapest and likeliest cause first.

Runs only after a non-finite step was detected (rare), so it may sync and allocate:

The evidence is what the step really trained on: the arguments of its training
forward calls (recorded by reference by the engine, micro-batches of gradient
accumulation included; in a loop that prefetches, not the batch fetched for the next
step), and the batches it fetched.

1. ``bad_data``: a forward input or the step's batch holds NaN/Inf. Named down to the
   forward call (micro-batch), the argument or batch entry and the sample rows (and
   dataset indices when the batch carries an ``index``/``indices``/``idx`` entry).
2. ``fp16_overflow``: float16 parameters or float16 autocast with no GradScaler seen:
   anything over 65504 becomes Inf.
3. ``optimization_blowup``: the run's own history before the step is far outside its
   range (``blowup.py``): the LR jumped, the weights moved far more in a step than
   they used to (the sampled update size), the grad norm or the loss rose over the
   spike rule's bar. Each named with its numbers and the step it started, the LR
   first; this comes before the replay's verdict on a module, which an exploding
   update turns non-finite wherever it happens to overflow first.
4. ``numerics``: the inputs are finite, yet re-running the step's forward calls (the
   same arguments) with forward hooks finds a module whose output is non-finite: the
   first such module in call order is named, with its type and whether its input was
   finite. If the forward is finite but the replayed gradients are not, the
   parameters whose gradients went non-finite are named (a backward-only fault such
   as sqrt at 0).
5. ``outside_model``: the forward replays finite and returns no loss, so the loss (and
   its backward) was computed outside the model (``criterion(model(x), y)``) and
   cannot be replayed: said plainly, with what to look at.
6. ``other_rank``: this rank's own gradients were finite (the ranks agree on the
   flag), or its replay is finite while gradients are all-reduced: another rank's
   report names the fault. ``not_reproducible``: a single rank's replay is finite:
   suspect hardware or a race.
7. ``unknown``: nothing to replay (no training forward went through the guard's
   model, or capture / replay is off).

The replay leaves the run exactly as it was: ``torch.autograd.grad`` returns gradients
instead of accumulating into ``.grad``; buffers (BatchNorm statistics) are copied back;
``torch.random.fork_rng`` restores the CPU and CUDA generators; the guard ignores the
replay's loss; DDP / torch.compile wrappers are bypassed so no collective is issued.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from guardrails.engine import model as _model
from guardrails.guards.nan import blowup as _blowup
from guardrails.metrics.events import json_safe
from guardrails.util import files, storage
from guardrails.util.text import shorten

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

NONFINITE_DIR = "nonfinite"
INDEX_KEYS = ("index", "indices", "idx")

HINTS = {
    "bad_data": (
        "inspect the saved batch and the samples named above; fix or filter them at the "
        "source (a corrupt record, a division by zero or log(0) in preprocessing)."
    ),
    "fp16_overflow": (
        "float16 overflows above 65504: train in bfloat16 (torch.autocast(device_type, "
        "dtype=torch.bfloat16): same range as float32, no loss scaling), or keep float16 "
        "with a torch.amp.GradScaler."
    ),
    "optimization_blowup": (
        "an optimization blow-up (LR / clipping / precision), not a data bug: lower the "
        "peak LR, add warmup, and clip the global grad norm (g.clip_grad_norm_(1.0))."
    ),
    "numerics": (
        "a numerics bug in that module: look for log(0), division by zero, sqrt of a "
        "negative, exp overflow or an unstable softmax; add an epsilon or clamp there."
    ),
    "not_reproducible": (
        "suspect hardware or a race: check `nvidia-smi -q -d ECC` and dmesg for Xid "
        "errors, non-deterministic kernels, or a loader that overwrites a buffer in place; "
        "resume from the last checkpoint."
    ),
    "other_rank": (
        "read the other ranks' diagnosis (events.jsonl, run_dir/nonfinite/): the rank "
        "whose batch or replay is non-finite is where the fault is."
    ),
    "outside_model": (
        "look at what the loop computes from the model's output: the loss function's "
        "inputs (targets, weights, masks: the saved batch), a custom loss (log(0), a "
        "division by zero, a mean over an empty mask); to let guardrails replay the loss "
        "too, return it from the model or pass guard(..., replay_fn=lambda model, batch: "
        "loss_of(model, batch))."
    ),
    "unknown": (
        "call the model passed to guard() for the training forward (guardrails records "
        "its calls), keep NanGuard's capture=True and replay=True, or pass "
        "guard(..., replay_fn=lambda model, batch: ...) to say how to run a batch."
    ),
}


#: ``optimization_blowup``'s hint for a loop that clips already (nanoGPT's
#: ``clip_grad_norm_(..., 1.0)``), which the general one would tell to clip.
HINT_BLOWUP_CLIPPED = (
    "an optimization blow-up (LR / precision), not a data bug: lower the peak LR or add "
    "warmup. The loop clips the grad norm already (clip_grad_norm_): that bounds the "
    "gradient, not the update, whose size an Adam-style optimizer sets by the LR."
)


#: ``optimization_blowup``'s hint when the LR jumped just before the fault.
HINT_LR_JUMP = (
    "the LR jumped just before the NaN: check the LR schedule (a scheduler stepped per "
    "batch where it counts epochs, a restart, an LR set by hand or left by a resumed "
    "scheduler) and lower the LR; this is an optimization blow-up, not a data or "
    "numerics bug."
)
HINT_LR_JUMP_CLIPPED = (
    " The loop clips the grad norm already (clip_grad_norm_): that bounds the gradient, "
    "not the update, whose size an Adam-style optimizer sets by the LR."
)


def diagnose(guard: Guard, **kw: Any) -> dict[str, Any]:
    """Classify the non-finite ``step``; save its batch. Returns a JSON-able dict with
    ``cause``, ``message``, ``hint`` and the evidence."""
    # A detection event may sync (it is rare); lift torch.cuda.set_sync_debug_mode
    # for its duration so a user checking their loop for syncs sees only the loop's.
    cuda = guard.device.type == "cuda"
    debug = torch.cuda.get_sync_debug_mode() if cuda else 0
    if debug:
        torch.cuda.set_sync_debug_mode(0)
    try:
        return _diagnose(guard, **kw)
    finally:
        if debug:
            torch.cuda.set_sync_debug_mode(debug)


def _diagnose(
    guard: Guard,
    *,
    step: int,
    loss: float,
    norm: float,
    lr: float,
    history: list[tuple[int, float, float, float]],
    updates: list[tuple[int, float]],
    drift: Callable[[], tuple[int, int, float] | None] | None,
    calls: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] | None,
    batches: list[Any] | None,
    other_rank: bool,
    optimizer: str | None,
    fp16: bool,
    scaler: bool,
    spike_factor: float,
    loss_spike_factor: float,
    replay: bool,
    replay_fn: Callable[[Any, Any], Any] | None,
    weights_step: int,
    save: bool,
) -> dict[str, Any]:
    diag: dict[str, Any] = {
        "step": step,
        "rank": guard.rank,
        "loss": loss,
        "grad_norm": norm,
        "lr": lr,
        "weights_step": weights_step,
        "history": [list(h) for h in history[-20:]],
    }
    if optimizer is not None:
        diag["optimizer"] = optimizer
    inputs = [_model.named_arguments(m, args, kwargs) for m, args, kwargs in calls or ()]
    # The forward inputs first (what the model saw), then the batches the step fetched
    # (a target or weight the loss outside the model used).
    bad = [("forward call", *b) for b in _nonfinite_samples(inputs)] if inputs else []
    if not bad and batches:
        bad = [("batch", *b) for b in _nonfinite_samples(batches)]
    blowup = _blowup.evidence(
        history,
        step=step,
        loss=loss,
        norm=norm,
        lr=lr,
        updates=updates,
        drift=None if drift is None else drift(),
        spike_factor=spike_factor,
        loss_spike_factor=loss_spike_factor,
    )
    found: dict[str, Any] = {}
    if replay and not bad and not other_rank and (calls or batches):
        found = _replay(guard, calls, batches, replay_fn)
    diag.update(found)

    diag["message"] = _explain(
        guard,
        diag,
        bad=bad,
        inputs=inputs,
        batches=batches,
        found=found,
        blowup=blowup,
        fp16=fp16,
        scaler=scaler,
        replay_fn=replay_fn,
        other_rank=other_rank,
        replay=replay,
    )
    clipped = diag["cause"] == "optimization_blowup" and guard.clip_norm_steps > 0
    diag["hint"] = HINT_BLOWUP_CLIPPED if clipped else HINTS[diag["cause"]]
    if diag["cause"] == "optimization_blowup" and blowup and blowup["lr_jump"]:
        diag["hint"] = HINT_LR_JUMP + (HINT_LR_JUMP_CLIPPED if clipped else "")
    if save:
        _save_told(guard, step, inputs, batches, diag)
    return diag


def _explain(
    guard: Guard,
    diag: dict[str, Any],
    *,
    bad: list[tuple[Any, ...]],
    inputs: list[Any],
    batches: list[Any] | None,
    found: dict[str, Any],
    blowup: dict[str, Any] | None,
    fp16: bool,
    scaler: bool,
    replay_fn: Callable[[Any, Any], Any] | None,
    other_rank: bool,
    replay: bool,
) -> str:
    """The cause, most specific first (into ``diag``), and the message that says it:
    bad data, fp16 without a scaler, a blow-up, the first non-finite module, a
    backward-only fault, or the rest (:func:`_elsewhere`)."""
    if bad:
        msg = _bad_data(guard, diag, bad, inputs, batches)
    elif fp16 and not scaler:
        diag["cause"] = "fp16_overflow"
        msg = "training in float16 with no GradScaler: a value overflowed float16's range"
        if found.get("module"):
            mod, kind = found["module"], found["module_type"]
            msg += f"; replaying the batch, `{mod}` ({kind}) overflowed first"
    elif blowup:
        diag.update(cause="optimization_blowup", evidence=blowup["evidence"])
        msg = "the steps before the NaN show a blow-up: " + blowup["text"]
    elif found.get("module"):
        n = len(inputs) if replay_fn is None else len(batches or ())
        msg = _first_module(guard, diag, found, calls=n)
    elif found.get("grad_params"):
        diag["cause"] = "numerics"
        names = found["grad_params"]
        msg = (
            "inputs and the replayed forward are finite, but the backward produces NaN/Inf "
            f"in the gradients of {_short(names)} (a backward-only fault: sqrt or pow at 0, "
            "a norm of a zero vector, atan2(0, 0))"
        )
        diag["module"] = names[-1].rsplit(".", 1)[0]
    else:
        msg = _elsewhere(guard, diag, found, other_rank=other_rank, replay=replay)
    return msg


def _bad_data(
    guard: Guard,
    diag: dict[str, Any],
    bad: list[tuple[Any, ...]],
    inputs: list[Any],
    batches: list[Any] | None,
) -> str:
    """The step's own data holds NaN/Inf: which call or batch, which tensor, which
    sample rows (and dataset indices where the batch carries them)."""
    what, mb, key, rows, dataset_rows = bad[0]
    n = len(inputs) if what == "forward call" else len(batches or ())
    where = f"{what} {mb + 1} of {n}, " if n > 1 else ""
    entry = "argument" if what == "forward call" else "entry"
    diag.update(cause="bad_data", samples=rows, tensor=key, dataset_indices=dataset_rows)
    msg = (
        f"the step's data holds NaN/Inf: {where}{entry} `{key}`, sample row(s) "
        f"{_short(rows)} of the batch on rank {guard.rank}"
    )
    if dataset_rows is not None:
        msg += f" (dataset indices {_short(dataset_rows)})"
    if len(bad) > 1:
        msg += f"; {len(bad) - 1} more tensor(s) in the batch also hold NaN/Inf"
    return msg


def _first_module(guard: Guard, diag: dict[str, Any], found: dict[str, Any], *, calls: int) -> str:
    """The replay found the first module whose output is NaN/Inf (of ``calls`` replayed
    forward calls): its input, its parameters, the sample rows that trigger it."""
    diag["cause"] = "numerics"
    inp = "finite" if found["input_finite"] else "NOT finite"
    msg = (
        f"inputs are finite, but replaying the batch, module `{found['module']}` "
        f"({found['module_type']}) is the first whose output is NaN/Inf; its input was "
        f"{inp}"
    )
    if found.get("params_finite") is False:
        msg += " and its own parameters hold NaN/Inf (they were already corrupt)"
    if found.get("rows"):
        where = f" of forward call {found['call'] + 1} of {calls}" if calls > 1 else ""
        diag["samples"] = found["rows"]
        msg += (
            f"; only sample row(s) {_short(found['rows'])}{where} of the batch on rank "
            f"{guard.rank} go non-finite there: the data of those samples triggers it"
        )
    return msg


def _elsewhere(
    guard: Guard, diag: dict[str, Any], found: dict[str, Any], *, other_rank: bool, replay: bool
) -> str:
    """This rank's data, forward and backward replay finite: another rank, the loss
    outside the model, not reproducible, or unknown (nothing replayed)."""
    step, weights_step = diag["step"], diag["weights_step"]
    if other_rank:
        diag["cause"] = "other_rank"
        return (
            f"this rank's own gradients were finite: another rank's were not, and every "
            f"rank skips the step together; the other ranks' reports under "
            f"{guard.run_dir / NONFINITE_DIR} name the culprit"
        )
    if found.get("replayed") and found.get("no_loss") and guard.world_size == 1:
        diag["cause"] = "outside_model"
        return (
            "the step's forward calls replay finite and the model returns no loss, so the "
            "NaN/Inf arose after the model, in the loss or its backward, which the loop "
            "computes itself (e.g. criterion(logits, y)) and guardrails cannot replay"
        )
    if found.get("replayed") and guard.world_size > 1:
        diag["cause"] = "other_rank"
        replayed = "forward replays" if found.get("no_loss") else "forward and backward replay"
        return (
            f"this rank's data is finite and its {replayed} finite: the NaN/Inf most "
            f"likely reached its gradients from another rank (gradients are all-reduced)"
            + (", or arose in the loss computed outside the model" if found.get("no_loss") else "")
            + f"; the other ranks' reports under {guard.run_dir / NONFINITE_DIR} name the culprit"
        )
    if found.get("replayed"):
        diag["cause"] = "not_reproducible"
        same = (
            "the same weights"
            if weights_step == step - 1
            else (
                f"the weights of step {weights_step} (the guard learned of step {step} "
                f"{weights_step - step + 1} step(s) late, without syncing)"
            )
        )
        return f"replaying the same batch on {same} gives a finite loss and gradients"
    diag["cause"] = "unknown"
    why = found.get("replay_error") or (
        "no training forward of the guarded model was recorded for this step, so "
        "there was nothing to replay"
        if replay
        else "replay is off"
    )
    return f"could not classify: {why}"


def _save_told(
    guard: Guard, step: int, inputs: list[Any], batches: list[Any] | None, diag: dict[str, Any]
) -> None:
    """The batch and the diagnosis saved, where, said in the message; a storage error
    said instead (a full or read-only disk must not turn a skipped step into a crash:
    the diagnosis itself is in the event and the log)."""
    try:
        diag["path"] = _save(guard, step, inputs, batches, diag)
        diag["message"] += f". Saved to {diag['path']}"
    except Exception as e:
        if not storage.is_storage_error(e):
            raise
        where = guard.run_dir / NONFINITE_DIR
        said = storage.cause_of(e, where) or f"{type(e).__name__}: {e}"
        diag["message"] += (
            f". The batch could not be saved under {where} ({said}): {storage.fix_for(e, where)}"
        )


# ---------------------------------------------------------------------- evidence


def _nonfinite_samples(
    batches: list[Any],
) -> list[tuple[int, str, list[int], list[int] | None]]:
    """(micro-batch, tensor key, sample rows, dataset indices) for every floating tensor
    of the batches that holds NaN/Inf."""
    out = []
    for mb, batch in enumerate(batches):
        flat = _flatten(batch)
        index = _dataset_index(batch)
        for key, t in flat.items():
            if not t.is_floating_point() and not t.is_complex():
                continue
            bad = ~torch.isfinite(t.detach())
            if not bad.any():
                continue
            rows = (
                bad.reshape(t.shape[0], -1).any(1).nonzero().flatten().tolist() if t.ndim else [0]
            )
            ds = None
            if index is not None and index.numel() >= max(rows) + 1:
                ds = [int(index[r]) for r in rows]
            out.append((mb, key, rows, ds))
    return out


def _dataset_index(batch: Any) -> Tensor | None:
    if isinstance(batch, Mapping):
        for k in INDEX_KEYS:
            v = batch.get(k)
            if isinstance(v, Tensor) and v.ndim == 1:
                return v.cpu()
    return None


# ---------------------------------------------------------------------- replay


def _replay(
    guard: Guard,
    calls: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] | None,
    batches: list[Any] | None,
    replay_fn: Callable[[Any, Any], Any] | None,
) -> dict:
    """Re-run the step's forward calls (or ``replay_fn`` over its batches) on the bare
    model(s) with a forward hook on every module; then, if the forward is finite, take
    the gradients with autograd.grad. Everything the run owns is left as it was."""
    model = _model.unwrap(guard.model)
    device = guard.device
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    first: dict[str, Any] = {}
    current = {"call": 0, "rows": 0}  # the call being replayed and its batch size

    def hook(name: str) -> Callable[..., None]:
        def fn(mod: nn.Module, args: Any, out: Any) -> None:
            if not first and not _finite(out):
                own = list(mod.parameters(recurse=False))
                first.update(
                    module=name or type(model).__name__,
                    module_type=type(mod).__name__,
                    input_finite=_finite(args),
                    params_finite=all(bool(torch.isfinite(p).all()) for p in own),
                    call=current["call"],
                )
                rows = _bad_rows(out, current["rows"])
                if rows is not None:  # only some samples: their data triggers it
                    first["rows"] = rows

        return fn

    # What to run: replay_fn over the fetched batches, or the calls as the loop made
    # them, on the bare module (no DDP collective, no recompilation).
    runs: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]
    if replay_fn is not None:
        runs = [(replay_fn, (model, _model.to_device(b, device)), {}) for b in batches or ()]
    else:
        runs = [(_model.unwrap(m), a, k) for m, a, k in calls or ()]
    if not runs:
        return {}
    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    devices = [device] if device.type == "cuda" else []
    result: dict[str, Any] = {"no_loss": True}
    try:
        # Not a training forward: its loss and inputs are not the step's.
        with guard.replaying(), torch.random.fork_rng(devices=devices), torch.enable_grad():
            for i, (fn, args, kwargs) in enumerate(runs):
                current.update(call=i, rows=_batch_size(args, kwargs))
                out = fn(*args, **kwargs)
                if first:
                    break
                loss = _model.find_loss(out)
                if loss is None or not named:
                    continue
                result["no_loss"] = False
                bad = _nonfinite_grads(loss, named)
                if bad:
                    result["grad_params"] = bad
                    break
        result["replayed"] = True
    except Exception as exc:  # the user's model; report, never mask the real fault
        how = "replay_fn" if replay_fn is not None else "the step's forward calls"
        result["replay_error"] = (
            f"replaying {how} raised {type(exc).__name__}: {exc} "
            "(pass guard(..., replay_fn=lambda model, batch: ...) to say how to run a batch)"
        )
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, copy in saved_buffers:
                b.copy_(copy)
    result.update(first)
    return result


def _nonfinite_grads(loss: Tensor, named: list[tuple[str, Tensor]]) -> list[str]:
    """The names of the parameters whose gradient of ``loss`` holds NaN/Inf (taken with
    autograd.grad: the parameters' ``.grad`` is left as it was)."""
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return [
        n
        for (n, _), g in zip(named, grads, strict=True)
        if g is not None and not bool(torch.isfinite(g).all())
    ]


def _batch_size(args: Any, kwargs: Any) -> int:
    """The leading size of a call's first tensor argument (its batch), or 0."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor) and a.ndim:
            return a.shape[0]
    return 0


def _bad_rows(out: Any, batch: int) -> list[int] | None:
    """The rows (samples) of a module's output that hold NaN/Inf, when its leading
    dimension is the batch's and not every row does; else ``None``."""
    t = (
        out
        if isinstance(out, Tensor)
        else next(
            (o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, Tensor)),
            None,
        )
    )
    if t is None or t.ndim == 0 or batch < 2 or t.shape[0] != batch or not t.is_floating_point():
        return None
    bad = (~torch.isfinite(t.detach())).reshape(batch, -1).any(1)
    rows = bad.nonzero().flatten().tolist()
    return rows if 0 < len(rows) < batch else None


def _finite(x: Any) -> bool:
    if isinstance(x, Tensor):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if isinstance(x, Mapping):
        return all(_finite(v) for v in x.values())
    if isinstance(x, (tuple, list)):
        return all(_finite(v) for v in x)
    return True


# ---------------------------------------------------------------------- capture


def _flatten(batch: Any, prefix: str = "") -> dict[str, Tensor]:
    """Tensors of a nested batch keyed by their path (``0``, ``1``, ``input_ids``...)."""
    if isinstance(batch, Tensor):
        return {prefix or "batch": batch}
    out: dict[str, Tensor] = {}
    if isinstance(batch, Mapping):
        items = ((str(k), v) for k, v in batch.items())
    elif isinstance(batch, (tuple, list)):
        items = ((str(i), v) for i, v in enumerate(batch))
    else:
        return out
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def _save(
    guard: Guard,
    step: int,
    inputs: list[dict[str, Any]],
    batches: list[Any] | None,
    diag: dict[str, Any],
) -> str:
    """Write the step's forward inputs and batches (safetensors) and the diagnosis
    (JSON) to ``run_dir/nonfinite/step<N>-rank<R>/``, atomically (temp dir, rename).
    Keys: ``call<i>.<argument>`` and ``batch<i>.<entry>``."""
    root = guard.run_dir / NONFINITE_DIR
    final = root / f"step{step:08d}-rank{guard.rank}"
    tmp = root / f".tmp-{uuid.uuid4().hex[:8]}"
    files.make_dirs(root)
    os.mkdir(tmp, files.DIR_MODE)
    try:
        return _save_into(tmp, final, root, inputs, batches, diag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written dump left behind
        raise


def _save_into(
    tmp: Path,
    final: Path,
    root: Path,
    inputs: list[dict[str, Any]],
    batches: list[Any] | None,
    diag: dict[str, Any],
) -> str:
    tensors = {}
    stored: set[tuple[Any, ...]] = set()
    for prefix, items in (("call", inputs), ("batch", batches or ())):
        for mb, item in enumerate(items):
            for key, t in _flatten(item).items():
                # A batch entry the forward got as is was saved as its argument already.
                view = (t.data_ptr(), tuple(t.shape), t.dtype, t.device)
                if prefix == "batch" and view in stored:
                    continue
                stored.add(view)
                # safetensors wants contiguous CPU tensors that share no storage.
                tensors[f"{prefix}{mb}.{key}"] = t.detach().to("cpu").contiguous().clone()
    if tensors:
        save_file(tensors, str(tmp / "batch.safetensors"))
    info = {k: v for k, v in diag.items() if k != "path"}
    info["batch_file"] = "batch.safetensors" if tensors else None
    info["batch_keys"] = sorted(tensors)
    (tmp / "info.json").write_text(json.dumps(json_safe(info), indent=2, default=str))
    files.restrict_tree(tmp)  # safetensors' and write_text's files: 0o666 less the umask
    if final.exists():  # a second diagnosis of the same step (a resumed run): keep both
        final = root / f"{final.name}-{uuid.uuid4().hex[:6]}"
    os.replace(tmp, final)
    return str(final)


def _short(items: list[Any], n: int = 8) -> str:
    return f"[{shorten(items, n)}]"
