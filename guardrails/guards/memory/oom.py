"""Out-of-memory errors explained: where, how much, what holds it, what to do.

A ``torch.OutOfMemoryError`` (or the CPU allocator's ``RuntimeError``) that ends the
guarded loop comes out as :class:`guardrails.OutOfMemoryError`, still a
``torch.OutOfMemoryError``, with the original as its ``__cause__``. It names the phase
(data / forward / backward / optimizer step), step and rank; the allocator's numbers
(allocated, reserved, peak, fragmentation = reserved - allocated); the largest live
tensors (one ``gc.get_objects()`` scan, at the error, plus the parameters, gradients
and optimizer state, which the GCScheduler's freeze hides from that scan); other
ranks' memory; and the usual remedies (no_grad for evaluation, fixing a leak, evening
out ranks, expandable segments, activation checkpointing, a smaller micro-batch, bf16,
sharded optimizer state), ranked by what those numbers say. An OOM on only some ranks
is its own diagnosis: the report compares this rank's peak with the others'.

Other ranks are read without a collective (one may be the reason this rank is stuck
or dying): in distributed runs each rank writes its memory numbers to
``run_dir/memory/rank-NNNNN.json`` at every leak check (one small file per rank per
check, written atomically) and at its own OOM; the failing rank reads them. So the
others' numbers are as of their last check, and the report says which step that was.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from guardrails._errors import OutOfMemoryError
from guardrails.guards.memory.stats import (
    fmt_bytes,
    meminfo,
    peak_rss_bytes,
    rss_bytes,
    same_device,
    storage,
)
from guardrails.util import files

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

logger = logging.getLogger("guardrails.memory")

#: What each value of ``Guard.phase`` means, in the error message.
PHASES = {
    "setup": "before the first batch (model / optimizer setup inside the guard)",
    "data": "in the loader's next() (loading, collating or pinning a batch)",
    "forward": "in the model's forward",
    "backward": "after the model's forward and before optimizer.step() (the loss, "
    "backward, gradient clipping)",
    "optimizer": "in optimizer.step()",
    "loop": "in the loop body outside forward, backward and optimizer.step() (moving a "
    "batch to the device, zero_grad, logging, evaluation)",
}

_CPU_OOM = re.compile(r"DefaultCPUAllocator: (can't allocate|not enough) memory")
_REQUESTED = re.compile(
    r"[Tt]ried to allocate (?:(\d+) bytes|([\d.]+) (B|KiB|MiB|GiB|TiB))"
)  # CPU: "you tried to allocate 123 bytes"; CUDA: "Tried to allocate 2.00 GiB"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def explain(guard: Guard, exc: BaseException, leak: dict[str, Any] | None) -> OutOfMemoryError:
    """The :class:`~guardrails.OutOfMemoryError` for ``exc`` (the caller raises it, with
    ``exc`` as its cause), after writing the ``oom`` event. ``leak``: the ``leak``
    event's fields if one was reported in this run (then fixing it is the first
    remedy)."""
    phase = guard.phase
    step = guard.step + 1  # the step in progress, 1-based as in metrics.parquet
    device = _oom_device(exc, guard.device)
    memory = _memory_summary(device, exc)
    tensors, by_kind = _live_tensors(guard, device)
    memory["by_kind"] = by_kind
    per_rank: dict[int, Any] | None = None
    if guard.world_size > 1:
        per_rank = read_rank_files(guard, device)
    remedies = _oom_remedies(guard, phase, memory, per_rank, leak)
    text = _oom_message(guard, phase, step, device, memory, tensors, per_rank)
    hint = "\n".join(f"  {i}. {text}" for i, (_, text) in enumerate(remedies, 1))
    keys = [key for key, _ in remedies]
    guard.event(
        "oom",
        level="error",
        message=text,
        ends_run=True,  # the OutOfMemoryError below carries it, printed once
        phase=phase,
        in_step=step,
        memory=memory,
        largest_tensors=tensors,
        per_rank=per_rank,
        remedies=keys,
    )
    return OutOfMemoryError(
        text,
        rank=guard.rank,
        step=step,
        hint="remedies, most likely first:\n" + hint,
        phase=phase,
        memory=memory,
        largest_tensors=tensors,
        remedies=keys,
        per_rank=per_rank,
    )


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error MemoryGuard explains: torch's
    ``OutOfMemoryError`` (CUDA and other accelerators) or the CPU allocator's
    ``RuntimeError``. Not one guardrails already explained."""
    if isinstance(exc, OutOfMemoryError):
        return False
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and bool(_CPU_OOM.search(str(exc)))


def _requested_bytes(exc: BaseException) -> int | None:
    m = _REQUESTED.search(str(exc))
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1))
    return int(float(m.group(2)) * _UNITS[m.group(3)])


def _oom_device(exc: BaseException, default: torch.device) -> torch.device:
    m = re.search(r"GPU (\d+) has a total capacity", str(exc))
    if m is not None and torch.cuda.is_available():
        return torch.device("cuda", int(m.group(1)))
    if _CPU_OOM.search(str(exc)):
        return torch.device("cpu")
    return default


def _memory_summary(device: torch.device, exc: BaseException) -> dict[str, Any]:
    """The allocator's numbers, in bytes. Read at the error only: host counters."""
    out: dict[str, Any] = {"device": str(device), "requested": _requested_bytes(exc)}
    if device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        out.update(
            allocated=allocated,
            reserved=reserved,
            peak=int(stats.get("allocated_bytes.all.peak", 0)),
            fragmentation=reserved - allocated,
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
        )
        try:
            free, total = torch.cuda.mem_get_info(device)
            out.update(free=int(free), total=int(total))
        except RuntimeError:  # the context may be unusable after some failures
            pass
        return out
    info = meminfo()
    out.update(
        rss=rss_bytes(),
        peak=peak_rss_bytes(),
        free=info.get("MemAvailable"),
        total=info.get("MemTotal"),
    )
    return out


def _live_tensors(
    guard: Guard, device: torch.device, top: int = 10
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The largest live tensors (one entry per storage, so views are not counted twice)
    and the bytes on ``device`` by kind: parameters, gradients, optimizer state, other.

    The GC lists every tensor Python can reach except frozen ones; the GCScheduler
    freezes the model and optimizer state after step 1, so those are added by name.
    Activations saved for backward live in the autograd graph, not in Python objects:
    on CUDA they are in ``allocated`` minus what is listed here.
    """
    names: dict[int, tuple[str, str]] = {}  # id(tensor) -> (kind, name)
    named: list[Tensor] = []
    for pname, p in guard.model.named_parameters():
        names[id(p)] = ("parameter", pname)
        named.append(p)
        if p.grad is not None:
            names[id(p.grad)] = ("gradient", f"{pname}.grad")
            named.append(p.grad)
    by_id = {id(p): n for n, p in guard.model.named_parameters()}
    states = [(p, s) for opt in guard.optimizers.values() for p, s in opt.state.items()]
    for p, state in states:
        for key, value in state.items() if isinstance(state, dict) else ():
            if isinstance(value, Tensor):
                names[id(value)] = ("optimizer_state", f"{key} of {by_id.get(id(p), '?')}")
                named.append(value)
    objs = gc.get_objects()
    try:
        types = {t for t in set(map(type, objs)) if issubclass(t, Tensor)}
        found = [o for o in objs if type(o) in types]
    finally:
        del objs
    seen: dict[Any, dict[str, Any]] = {}
    totals = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "other_tensors": 0}
    plural = {
        "parameter": "parameters",
        "gradient": "gradients",
        "optimizer_state": "optimizer_state",
        "other": "other_tensors",
    }
    for t in named + found:
        found_storage = storage(t)
        if found_storage is None:
            continue
        key, nbytes = found_storage
        if key in seen or nbytes == 0:
            continue
        kind, name = names.get(id(t), ("other", None))
        seen[key] = {
            "name": name,
            "kind": kind,
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "device": str(t.device),
            "bytes": int(nbytes),
            "holds_graph": bool(t.requires_grad and not t.is_leaf),
        }
        if same_device(t.device, device):
            totals[plural[kind]] += int(nbytes)
    del found, named
    largest = sorted(seen.values(), key=lambda d: d["bytes"], reverse=True)[:top]
    return largest, totals


# ---------------------------------------------------------------------- ranks


def rank_file(run_dir: Path, rank: int) -> Path:
    return run_dir / "memory" / f"rank-{rank:05d}.json"


def write_rank_file(path: Path, guard: Guard, device: torch.device) -> None:
    """This rank's memory numbers for the others to read at an OOM: one small atomic
    write (temp file, then rename), at leak checks and at this rank's own OOM."""
    record: dict[str, Any] = {"rank": guard.rank, "step": guard.step, "time": time.time()}
    if device.type == "cuda":
        record.update(
            allocated=int(torch.cuda.memory_allocated(device)),
            reserved=int(torch.cuda.memory_reserved(device)),
            peak=int(torch.cuda.max_memory_allocated(device)),
        )
    else:
        record.update(allocated=rss_bytes(), reserved=None, peak=peak_rss_bytes())
    try:
        files.make_dirs(path.parent)
        tmp = path.with_name(f".tmp-{path.name}")
        files.write_text(tmp, json.dumps(record))
        os.replace(tmp, path)
    except OSError as err:  # a full or read-only disk must not stop training
        logger.warning("guardrails: could not write %s: %s", path, err)


def read_rank_files(guard: Guard, device: torch.device) -> dict[int, Any]:
    write_rank_file(rank_file(guard.run_dir, guard.rank), guard, device)
    out: dict[int, Any] = {}
    for path in sorted((guard.run_dir / "memory").glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and 0 <= record.get("rank", -1) < guard.world_size:
            out[int(record["rank"])] = record
    return out


def _imbalance(rank: int, per_rank: dict[int, Any] | None) -> tuple[float, float] | None:
    """(this rank's peak, the median of the others'), when the others are known."""
    if not per_rank or rank not in per_rank:
        return None
    others = sorted(r["peak"] for k, r in per_rank.items() if k != rank and r.get("peak"))
    mine = per_rank[rank].get("peak")
    if not others or not mine:
        return None
    return float(mine), float(others[len(others) // 2])


# ---------------------------------------------------------------------- the message


def _oom_message(
    guard: Guard,
    phase: str,
    step: int,
    device: torch.device,
    memory: dict[str, Any],
    tensors: list[dict[str, Any]],
    per_rank: dict[int, Any] | None,
) -> str:
    mode = "" if guard.model.training else " (the model is in eval() mode)"
    lines = [
        f"out of memory on {device} {PHASES.get(phase, phase)}{mode}, during step {step}"
        f" ({guard.step} completed)"
        + (
            f"; tried to allocate {fmt_bytes(memory['requested'])}"
            if memory.get("requested")
            else ""
        )
        + (
            f" with {fmt_bytes(memory['free'])} free of {fmt_bytes(memory['total'])}"
            if memory.get("total")
            else ""
        )
        + "."
    ]
    if "reserved" in memory:
        lines.append(
            f"memory: allocated {fmt_bytes(memory['allocated'])}, reserved "
            f"{fmt_bytes(memory['reserved'])} (fragmentation, reserved but not allocated: "
            f"{fmt_bytes(memory['fragmentation'])}), peak {fmt_bytes(memory['peak'])}."
        )
    else:
        lines.append(
            f"memory: RSS {fmt_bytes(memory['rss'])}, peak RSS {fmt_bytes(memory['peak'])}."
        )
    kinds = memory["by_kind"]
    parts = [
        f"parameters {fmt_bytes(kinds['parameters'])}",
        f"gradients {fmt_bytes(kinds['gradients'])}",
        f"optimizer state {fmt_bytes(kinds['optimizer_state'])}",
        f"other live tensors {fmt_bytes(kinds['other_tensors'])}",
    ]
    if "allocated" in memory:
        rest = memory["allocated"] - sum(kinds.values())
        parts.append(f"not in any Python tensor (saved activations, autograd) {fmt_bytes(rest)}")
    lines.append(f"on {device} by kind: " + ", ".join(parts) + ".")
    if tensors:
        lines.append("largest live tensors:")
        for t in tensors[:5]:
            name = f" {t['name']}" if t["name"] else ""
            graph = ", holds a graph" if t["holds_graph"] else ""
            shape = "x".join(map(str, t["shape"])) or "0-d"
            lines.append(
                f"  {fmt_bytes(t['bytes'])}  {t['kind']}{name}: {shape} {t['dtype']} on "
                f"{t['device']}{graph}"
            )
    if per_rank:
        shown = ", ".join(
            f"rank {r}: peak {fmt_bytes(rec.get('peak'))} (step {rec.get('step')})"
            for r, rec in sorted(per_rank.items())
        )
        lines.append(
            f"ranks, as of their last memory check (run_dir/memory/, no collective): {shown}."
        )
    return "\n".join(lines)


def _oom_remedies(
    guard: Guard,
    phase: str,
    memory: dict[str, Any],
    per_rank: dict[int, Any] | None,
    leak: dict[str, Any] | None,
) -> list[tuple[str, str]]:
    """The usual OOM remedies, each scored by what the numbers say; best first (equal
    scores in the order below)."""
    scored = [
        *_misuse_remedies(guard, phase, per_rank, leak),
        *_fragmentation_remedy(memory),
        *_activation_remedies(phase, memory),
        *_state_remedies(guard, phase, memory),
    ]
    scored.sort(key=lambda s: -s[0])
    return [(key, text) for _, key, text in scored]


#: A remedy: (score, key, text).
_Scored = tuple[int, str, str]


def _state_bytes(memory: dict[str, Any]) -> int:
    """The bytes of parameters, gradients and optimizer state."""
    kinds = memory["by_kind"]
    return kinds["parameters"] + kinds["gradients"] + kinds["optimizer_state"]


def _misuse_remedies(
    guard: Guard,
    phase: str,
    per_rank: dict[int, Any] | None,
    leak: dict[str, Any] | None,
) -> list[_Scored]:
    """An eval forward with grad, a leak before the OOM, one rank using more."""
    scored: list[_Scored] = []
    in_model = phase in ("forward", "backward")
    if in_model and not guard.model.training:
        scored.append(
            (
                100,
                "no_grad_eval",
                "the OOM is in an evaluation forward (model.eval()): run it under "
                "`with torch.no_grad():` (or torch.inference_mode()) if it is not; "
                "otherwise each forward keeps its activations for a backward that never "
                "comes.",
            )
        )
    if leak is not None:
        scored.append(
            (
                95,
                "fix_leak",
                f"memory was growing before the OOM ({leak['cause']}"
                + (f", held by {leak['held_by']}" if leak.get("held_by") else "")
                + "): see the `leak` event; fix that first, the OOM is its symptom.",
            )
        )
    imbalance = _imbalance(guard.rank, per_rank)
    if imbalance is not None and imbalance[0] > 1.2 * imbalance[1]:
        scored.append(
            (
                90,
                "rank_imbalance",
                f"this rank peaked at {fmt_bytes(imbalance[0])}, the other ranks at a median of "
                f"{fmt_bytes(imbalance[1])}: make every rank get the same batch size "
                "(DistributedSampler, drop_last=True) and look for work done on this rank "
                "only (metrics, logging tensors, an extra eval on rank 0).",
            )
        )
    return scored


def _fragmentation_remedy(memory: dict[str, Any]) -> list[_Scored]:
    """expandable_segments, when the free memory is there in pieces."""
    scored: list[_Scored] = []
    requested = memory.get("requested")
    frag = memory.get("fragmentation")
    if frag is not None and memory.get("reserved"):
        if requested and frag >= requested:
            score = 92
            why = f"more than the {fmt_bytes(requested)} requested: the memory exists, in pieces"
        elif frag > 0.1 * memory["reserved"]:
            score = 60
            why = f"{frag / memory['reserved']:.0%} of what PyTorch reserved"
        else:
            score = 0
            why = ""
        if score:
            scored.append(
                (
                    score,
                    "expandable_segments",
                    f"fragmentation is {fmt_bytes(frag)} ({why}): start the process with "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so freed blocks "
                    "serve other sizes.",
                )
            )
    return scored


def _activation_remedies(phase: str, memory: dict[str, Any]) -> list[_Scored]:
    """Fewer activations kept: checkpointing, a smaller micro-batch, bf16."""
    scored: list[_Scored] = []
    allocated = memory.get("allocated")
    in_model = phase in ("forward", "backward")
    state = _state_bytes(memory)
    activations = None if allocated is None else allocated - state
    act_share = activations / allocated if activations is not None and allocated else None
    if phase in ("forward", "backward", "loop"):
        score = 85 if act_share is not None and act_share >= 0.5 else 55
        share = (
            f" ({fmt_bytes(activations)}, {act_share:.0%} of allocated, is not parameters, "
            "gradients or optimizer state)"
            if act_share is not None
            else ""
        )
        scored.append(
            (
                score,
                "activation_checkpointing",
                f"activations dominate{share}: use activation checkpointing "
                "(torch.utils.checkpoint around each block) to recompute them in backward "
                "instead of keeping them.",
            )
        )
    scored.append(
        (
            80 if in_model else 40,
            "smaller_micro_batch",
            "halve the micro-batch (or the sequence length) and accumulate gradients over "
            "2 micro-batches per optimizer step: the same effective batch with about half "
            "the activation memory.",
        )
    )
    if in_model:
        scored.append(
            (
                50,
                "bf16",
                "run the forward under torch.autocast(device_type, dtype=torch.bfloat16): "
                "activations take half the bytes.",
            )
        )
    return scored


def _state_remedies(guard: Guard, phase: str, memory: dict[str, Any]) -> list[_Scored]:
    """Optimizer state sharded, a smaller loader batch, memory held across steps."""
    scored: list[_Scored] = []
    allocated = memory.get("allocated")
    state = _state_bytes(memory)
    if phase == "optimizer" or (allocated and state >= 0.5 * allocated):
        first = phase == "optimizer" and guard.step == 0
        scored.append(
            (
                88 if first else 65,
                "shard_optimizer_state",
                (
                    "the first optimizer step allocates the optimizer's state (Adam: "
                    "8 bytes per fp32 parameter, ~12 with master weights)"
                    if first
                    else f"parameters, gradients and optimizer state take {fmt_bytes(state)}"
                )
                + ": shard them (FSDP / ZeRO), use an 8-bit optimizer (e.g. "
                "bitsandbytes AdamW8bit) or offload optimizer state to the CPU.",
            )
        )
    if phase == "data":
        scored.append(
            (
                85,
                "smaller_batch_in_loader",
                "the loader ran out of memory building a batch: lower its batch size, or "
                "move device-side transforms out of collate_fn / the dataset.",
            )
        )
    if guard.step > 0 and phase in ("backward", "optimizer"):
        scored.append(
            (
                45,
                "memory_held_across_steps",
                f"{guard.step} earlier steps fit and this one did not: look for memory "
                "held across steps (kept losses or outputs, retain_graph=True) and for "
                "fragmentation.",
            )
        )
    return scored
