"""Why did this step go non-finite? Seed 003's triage, in the order it recommends.

Runs only after a non-finite step was detected (rare), so it may sync and allocate:

1. ``bad_data``: the batch itself holds NaN/Inf. Named down to the micro-batch, the
   tensor inside the batch and the sample rows (and dataset indices when the batch
   carries an ``index``/``indices``/``idx`` entry).
2. ``fp16_overflow``: float16 parameters or float16 autocast with no GradScaler seen:
   anything over 65504 becomes Inf.
3. ``optimization_blowup``: "a spike one step before the NaN": the grad norm or the
   loss jumped (``spike_factor`` times the running median) in the last few finite
   steps, or the LR jumped. Reported with the numbers.
4. ``numerics``: the inputs are finite, yet replaying the batch through the model with
   forward hooks finds a module whose output is non-finite: the first such module in
   call order is named, with its type and whether its input was finite. If the
   forward is finite but the replayed gradients are not, the parameters whose
   gradients went non-finite are named (a backward-only fault such as sqrt at 0).
5. ``not_reproducible``: the replay is finite: suspect hardware or a race. In a
   multi-rank run a finite local replay means the fault came from another rank
   through the gradient all-reduce: ``other_rank`` (that rank's report names it).
6. ``unknown``: no batch to replay (the loop does not iterate the guard, or capture /
   replay is off).

The replay leaves the run exactly as it was: ``torch.autograd.grad`` returns gradients
instead of accumulating into ``.grad``; buffers (BatchNorm statistics) are copied back;
``torch.random.fork_rng`` restores the CPU and CUDA generators; the guard ignores the
replay's loss; DDP / torch.compile wrappers are bypassed so no collective is issued.
"""

from __future__ import annotations

import json
import os
import statistics
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from guardrails._events import json_safe
from guardrails._text import shorten

if TYPE_CHECKING:
    from guardrails._guard import Guard

NONFINITE_DIR = "nonfinite"
#: Finite steps before the fault that are searched for a spike.
LOOKBACK_STEPS = 5
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
    "unknown": (
        "iterate the guard (for batch in g) with capture=True and replay=True so the batch "
        "can be replayed, or pass replay_fn=lambda model, batch: ... if the model is not "
        "called as model(*batch)."
    ),
}


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
    batches: list[Any] | None,
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
    bad = _nonfinite_samples(batches) if batches else []
    blowup = _blowup_evidence(history, lr, spike_factor, loss_spike_factor)
    found: dict[str, Any] = {}
    if replay and batches and not bad:
        found = _replay(guard, batches, replay_fn)
    diag.update(found)

    if bad:
        mb, key, rows, dataset_rows = bad[0]
        where = f"micro-batch {mb}, " if len(batches or ()) > 1 else ""
        diag.update(cause="bad_data", samples=rows, tensor=key, dataset_indices=dataset_rows)
        msg = (
            f"the batch itself holds NaN/Inf: {where}tensor `{key}`, sample row(s) "
            f"{_short(rows)} of the batch on rank {guard.rank}"
        )
        if dataset_rows is not None:
            msg += f" (dataset indices {_short(dataset_rows)})"
        if len(bad) > 1:
            msg += f"; {len(bad) - 1} more tensor(s) in the batch also hold NaN/Inf"
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
        diag["cause"] = "numerics"
        inp = "finite" if found["input_finite"] else "NOT finite"
        msg = (
            f"inputs are finite, but replaying the batch, module `{found['module']}` "
            f"({found['module_type']}) is the first whose output is NaN/Inf; its input was "
            f"{inp}"
        )
        if found.get("params_finite") is False:
            msg += " and its own parameters hold NaN/Inf (they were already corrupt)"
    elif found.get("grad_params"):
        diag["cause"] = "numerics"
        names = found["grad_params"]
        msg = (
            "inputs and the replayed forward are finite, but the backward produces NaN/Inf "
            f"in the gradients of {_short(names)} (a backward-only fault: sqrt or pow at 0, "
            "a norm of a zero vector, atan2(0, 0))"
        )
        diag["module"] = names[-1].rsplit(".", 1)[0]
    elif found.get("replayed") and guard.world_size > 1:
        diag["cause"] = "other_rank"
        msg = (
            f"this rank's batch, forward and backward replay finite: the NaN/Inf reached "
            f"its gradients from another rank (gradients are all-reduced); the other "
            f"ranks' reports under {guard.run_dir / NONFINITE_DIR} name the culprit"
        )
    elif found.get("replayed"):
        diag["cause"] = "not_reproducible"
        same = (
            "the same weights"
            if weights_step == step - 1
            else (
                f"the weights of step {weights_step} (the guard learned of step {step} "
                f"{weights_step - step + 1} step(s) late, without syncing)"
            )
        )
        msg = f"replaying the same batch on {same} gives a finite loss and gradients"
    else:
        diag["cause"] = "unknown"
        why = found.get("replay_error") or "there was no batch to replay"
        msg = f"could not classify: {why}"
    diag["message"] = msg
    diag["hint"] = HINTS[diag["cause"]]
    if save:
        diag["path"] = _save(guard, step, batches, diag)
        diag["message"] += f". Saved to {diag['path']}"
    return diag


# ---------------------------------------------------------------------- evidence


def _blowup_evidence(
    history: list[tuple[int, float, float, float]],
    lr: float,
    spike_factor: float,
    loss_spike_factor: float,
) -> dict[str, Any] | None:
    """A grad-norm / loss spike or an LR jump in the last finite steps before the fault,
    relative to the steps before them."""
    if len(history) < LOOKBACK_STEPS + 5:
        return None
    recent, earlier = history[-LOOKBACK_STEPS:], history[:-LOOKBACK_STEPS]
    norm_med = statistics.median(h[2] for h in earlier)
    losses = [h[1] for h in earlier if h[1] == h[1]]
    loss_med = statistics.median(losses) if losses else float("nan")
    lr_med = statistics.median(h[3] for h in earlier)
    peak_norm = max(h[2] for h in recent)
    peak_loss = max((h[1] for h in recent if h[1] == h[1]), default=float("nan"))
    reasons = []
    if norm_med > 0 and peak_norm > spike_factor * norm_med:
        reasons.append(
            f"grad norm up to {peak_norm:.3g}, "
            f"{peak_norm / norm_med:.0f}x its median {norm_med:.3g}"
        )
    if loss_med > 0 and peak_loss > loss_spike_factor * loss_med:
        reasons.append(f"loss up to {peak_loss:.4g} from a median of {loss_med:.4g}")
    if lr_med > 0 and lr > 10 * lr_med:
        reasons.append(f"LR {lr:.3g}, {lr / lr_med:.0f}x its median {lr_med:.3g}")
    if not reasons:
        return None
    trend = ", ".join(f"{h[2]:.3g}" for h in recent)
    return {
        "text": "; ".join(reasons) + f" (grad norms of the last {len(recent)} steps: {trend}; "
        f"LR {lr:.3g})",
        "evidence": {
            "grad_norm_median": norm_med,
            "recent_grad_norms": [h[2] for h in recent],
            "loss_median": loss_med,
            "recent_losses": [h[1] for h in recent],
            "lr": lr,
            "lr_median": lr_med,
        },
    }


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


def _replay(guard: Guard, batches: list[Any], replay_fn: Callable[[Any, Any], Any] | None) -> dict:
    """Run the step's batches through the bare model with a forward hook on every
    module; then, if the forward is finite, take the gradients with autograd.grad.
    Everything the run owns is left as it was."""
    from guardrails._guard import _find_loss

    model = _unwrap(guard.model)
    device = guard.device
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    first: dict[str, Any] = {}

    def hook(name: str) -> Callable[..., None]:
        def fn(mod: nn.Module, args: Any, out: Any) -> None:
            if not first and not _finite(out):
                own = list(mod.parameters(recurse=False))
                first.update(
                    module=name or type(model).__name__,
                    module_type=type(mod).__name__,
                    input_finite=_finite(args),
                    params_finite=all(bool(torch.isfinite(p).all()) for p in own),
                )

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    devices = [device] if device.type == "cuda" else []
    result: dict[str, Any] = {}
    guard._replaying = True
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            for batch in batches:
                batch = _to(batch, device)
                out = replay_fn(model, batch) if replay_fn is not None else _call(model, batch)
                if first:
                    break
                loss = _find_loss(out)
                if loss is None or not named:
                    continue
                grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
                bad = [
                    n
                    for (n, _), g in zip(named, grads, strict=True)
                    if g is not None and not bool(torch.isfinite(g).all())
                ]
                if bad:
                    result["grad_params"] = bad
                    break
        result["replayed"] = True
    except Exception as exc:  # the user's model; report, never mask the real fault
        result["replay_error"] = (
            f"replaying the batch raised {type(exc).__name__}: {exc} "
            "(pass replay_fn=lambda model, batch: ... to NanGuard)"
        )
    finally:
        guard._replaying = False
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, copy in saved_buffers:
                b.copy_(copy)
    result.update(first)
    return result


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP would all-reduce during the replay's backward; the compiled wrapper would
    # recompile for the hooks. The bare module runs the same weights.
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return (
            type(batch)(_to(v, device) for v in batch)
            if isinstance(batch, tuple)
            else [_to(v, device) for v in batch]
        )
    return batch


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


def _save(guard: Guard, step: int, batches: list[Any] | None, diag: dict[str, Any]) -> str:
    """Write the batch (safetensors) and the diagnosis (JSON) to
    ``run_dir/nonfinite/step<N>-rank<R>/``, atomically (temp dir, then rename)."""
    root = guard.run_dir / NONFINITE_DIR
    final = root / f"step{step:08d}-rank{guard.rank}"
    tmp = root / f".tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    tensors = {}
    for mb, batch in enumerate(batches or ()):
        for key, t in _flatten(batch).items():
            # safetensors wants contiguous CPU tensors that share no storage.
            tensors[f"{mb}.{key}"] = t.detach().to("cpu").contiguous().clone()
    if tensors:
        save_file(tensors, str(tmp / "batch.safetensors"))
    info = {k: v for k, v in diag.items() if k != "path"}
    info["batch_file"] = "batch.safetensors" if tensors else None
    info["batch_keys"] = sorted(tensors)
    (tmp / "info.json").write_text(json.dumps(json_safe(info), indent=2, default=str))
    if final.exists():  # a second diagnosis of the same step (a resumed run): keep both
        final = root / f"{final.name}-{uuid.uuid4().hex[:6]}"
    os.replace(tmp, final)
    return str(final)


def _short(items: list[Any], n: int = 8) -> str:
    return f"[{shorten(items, n)}]"
