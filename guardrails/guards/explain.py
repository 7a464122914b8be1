"""The error translator: the torch / NCCL / gloo / CUDA errors distributed training meets
most (timeouts, a peer gone, a port in use, an invalid device ordinal...), each with its
cause and fix.

``explain(exc)`` walks the exception and its chain (``__cause__`` / ``__context__``: torch
often wraps the backend's error) for a known signature and returns the explanation text,
or ``""`` when none matches. Under ``guard()`` the :class:`ErrorExplainer` component
re-raises a matching error that ends the loop as a guardrails error of the matching
family (chained: the original is its ``__cause__``), adding what the guard knows: rank,
step, phase and the last collective the auditor saw.

This module imports nothing heavy at import time (no torch), so ``@guardrails.record``
can call :func:`explain` on any failure, even one raised while torch is importing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guardrails.engine.component import Component

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard


@dataclass(frozen=True)
class Signature:
    """A known failure: ``patterns`` (regexes, case-insensitive) matched against the
    error's text; ``family`` is the guardrails error class it becomes."""

    key: str
    patterns: tuple[str, ...]
    family: str
    title: str
    causes: tuple[str, ...]
    fix: str
    #: Matched against the exception's class name when the text says nothing.
    class_names: tuple[str, ...] = ()


# Order matters: the first match wins, so specific signatures come before general ones
# (a gloo size mismatch mentions neither "timeout" nor "reset"; an NCCL watchdog
# timeout message can mention "aborted").
SIGNATURES: tuple[Signature, ...] = (
    Signature(
        "ddp_unused_parameters",
        (r"Expected to have finished reduction in the prior iteration",),
        "GuardrailsError",
        "DDP found parameters that did not receive a gradient",
        (
            "the model has parameters that were not used to compute the loss in the last "
            "iteration (a branch or head skipped, a frozen part not marked "
            "requires_grad=False, outputs that do not all reach the loss)",
        ),
        "pass find_unused_parameters=True to DistributedDataParallel (costs a graph "
        "traversal per step), or set requires_grad=False on parameters that never train, "
        "or make every output participate in the loss. guardrails.GuardedDDP names the "
        "parameters.",
    ),
    Signature(
        "ddp_model_mismatch",
        (r"DDP expects same model across all ranks",),
        "ConfigMismatchError",
        "ranks built different models",
        (
            "the model's structure depends on something that differs by rank (a config, "
            "a vocabulary or dataset size read per rank, a code path on rank 0)",
        ),
        "build the model from the same config on every rank; guardrails.GuardedDDP and "
        "guard()'s preflight name the parameters that differ.",
    ),
    Signature(
        "collective_size_mismatch",
        (
            r"Received data size doesn't match expected size",
            # torch 2.8's gloo (read in its wheel; 2.13's names the cause) says only:
            # "[enforce fail at .../tcp/pair.cc:446] op.preamble.length <= op.nbytes. 32 vs 4"
            r"op\.preamble\.length <= op\.nbytes",
            r"collective mismatch",
            r"Detected mismatch between collectives",
        ),
        "CollectiveMismatchError",
        "ranks called different collectives",
        (
            "tensor size mismatch across ranks: one rank's tensor has a different shape "
            "(uneven last batch, a per-rank sequence length)",
            "ranks run different code paths (a conditional collective, logging or "
            "checkpoint code only rank 0 runs that includes a collective)",
        ),
        "make every rank call the same collectives in the same order with the same "
        "shapes; check rank-0-only branches and the last batch (drop_last=True, "
        "DistributedSampler). guard() names the collective, rank and line "
        "(CollectiveAuditor); TORCH_DISTRIBUTED_DEBUG=DETAIL also flags it, slowly.",
    ),
    Signature(
        "nccl_timeout",
        (
            r"Watchdog caught collective operation timeout",
            r"NCCL timeout",
            r"watchdog timeout",
            r"Timed out waiting \d+ ?ms for (send|recv) operation",
            r"ProcessGroupNCCL.*timed? ?out",
            r"collective operation timeout",
        ),
        "HangError",
        "a collective timed out: ranks were waiting for each other",
        (
            "one rank did not reach the collective: a deadlock in the code (a missing or "
            "conditional collective, a barrier only some ranks call)",
            "data exhaustion on one rank: its loader ran out while others waited",
            "tensor size mismatch across ranks",
            "one GPU much slower (thermal throttling, a faulty GPU) or a network problem "
            "between GPUs (InfiniBand / NVLink)",
        ),
        "run under guard() so a stuck rank is named within the watchdog's "
        "hang_timeout_s with every rank's stack; check asymmetric conditions in the code "
        "and that every rank gets "
        "the same number of batches; check the GPUs (`nvidia-smi`, `nvidia-smi topo -m`, "
        "`python -m guardrails doctor`). Raising the timeout only waits longer.",
    ),
    Signature(
        "rendezvous_timeout",
        (
            r"waiting for clients",
            r"Timed out after \d+ seconds waiting",
            r"Socket Timeout",
            r"Connection refused",
            r"failed to connect to .*:\d+",
        ),
        "LaunchError",
        "the ranks never met at the rendezvous",
        (
            "wrong MASTER_ADDR / MASTER_PORT (a worker cannot reach rank 0's store)",
            "a wrong WORLD_SIZE or a rank that never started",
            "a blocked rendezvous port (firewall)",
        ),
        "check MASTER_ADDR, MASTER_PORT and WORLD_SIZE on every node (guardrails.record "
        "checks them at launch); with several network interfaces pin one "
        "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME).",
    ),
    Signature(
        "address_in_use",
        (
            r"Address already in use",
            r"EADDRINUSE",
            r"failed to listen on any local network address",
            r"server socket has failed to (listen|bind)",
        ),
        "LaunchError",
        "the rendezvous port is already in use",
        ("a previous training run left zombie processes that still hold the port",),
        "kill the leftover run (find it with `lsof -i :{port}`, then `kill <pid>`), "
        "or use another port: torchrun --master-port={next_port}.",
    ),
    Signature(
        "invalid_device_ordinal",
        (r"invalid device ordinal",),
        "LaunchError",
        "the code asked for a GPU this process cannot see",
        (
            "CUDA_VISIBLE_DEVICES set manually conflicts with torchrun's assignment: "
            "each process sees fewer GPUs than LOCAL_RANK assumes",
            "more processes per node (--nproc_per_node) than GPUs",
        ),
        "let torchrun assign GPUs: do not set CUDA_VISIBLE_DEVICES per process, and use "
        "torch.device('cuda', int(os.environ['LOCAL_RANK'])); if you restrict GPUs, set "
        "CUDA_VISIBLE_DEVICES once for torchrun and use --nproc_per_node equal to their "
        "count.",
    ),
    Signature(
        "duplicate_gpu",
        (r"Duplicate GPU detected",),
        "LaunchError",
        "two ranks use the same GPU",
        ("torch.cuda.set_device(LOCAL_RANK) was not called, so every rank used cuda:0",),
        "call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before "
        "init_process_group, and move the model to that device.",
    ),
    Signature(
        "cuda_oom",
        (r"CUDA out of memory", r"DefaultCPUAllocator: (can't allocate|not enough) memory"),
        "OutOfMemoryError",
        "out of memory",
        (
            "activations dominate (batch or sequence too large)",
            "optimizer states (Adam: about 12 bytes per parameter)",
            "fragmentation, or accumulation holding graphs (OOM only in backward or at a "
            "later step)",
            "unbalanced memory across ranks (rank-0-only allocations, OOM on only some GPUs)",
        ),
        "gradient checkpointing, a smaller batch with gradient accumulation, bf16; "
        "FSDP/ZeRO to shard optimizer states; "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for fragmentation; "
        "torch.no_grad() for evaluation. guard() (explain_oom) names the largest tensors.",
        ("OutOfMemoryError",),
    ),
    Signature(
        "connection_reset",
        (
            r"Connection reset by peer",
            r"Connection closed by peer",
            r"Broken pipe",
            r"NCCL communicator was aborted",
            r"remote process exited or there was a network error",
        ),
        "RankFailedError",
        "another rank went away in the middle of a collective",
        (
            "a rank died (an exception, an OOM, a kill) and its peers lost the connection: "
            "this rank's error is a consequence, the root cause is in the first rank "
            "that failed",
            "a network failure between nodes",
        ),
        "find the rank that failed first: search every rank's log for the first "
        "traceback (torchrun prints it as the root cause when main is decorated with "
        "@guardrails.record).",
    ),
    Signature(
        "child_failed",
        (r"ChildFailedError",),
        "RankFailedError",
        "torchrun reports that a worker failed, without its error",
        ("torchrun captures the workers' stderr and only shows a generic failure",),
        "decorate main with @guardrails.record (or torch's @record) so the worker's error "
        "reaches torchrun's summary; then look at the first failing rank's log.",
        ("ChildFailedError",),
    ),
)

_COMPILED = [
    (s, re.compile("|".join(f"(?:{p})" for p in s.patterns), re.IGNORECASE)) for s in SIGNATURES
]


def match(exc: BaseException) -> Signature | None:
    """The first known signature in ``exc`` or the exceptions it chains, else ``None``."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(chain) < 8:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for sig, pattern in _COMPILED:
        for e in chain:
            if pattern.search(str(e)) or type(e).__name__ in sig.class_names:
                return sig
    return None


def explain(exc: BaseException, guard: Guard | None = None) -> str:
    """The explanation of a failure: what it means, its likely causes and the fix, in
    the user's terms, plus what ``guard`` knows (rank, step, phase, last collective).
    ``""`` when ``exc`` is not a failure guardrails knows."""
    if not isinstance(exc, BaseException):
        raise TypeError(
            f"explain() takes the exception to explain (explain(err) in an except block), "
            f"got {type(exc).__name__} {exc!r}"[:200]
        )
    sig = match(exc)
    if sig is None:
        return ""
    return _render(sig, exc, _context(guard))[0]


def translate(exc: BaseException, guard: Guard | None = None) -> BaseException | None:
    """``exc`` as a guardrails error of its family (to raise ``from exc``), or ``None``
    when it is not a known signature or is already a guardrails error."""
    from guardrails import _errors

    if isinstance(exc, _errors.GuardrailsError):
        return None
    sig = match(exc)
    if sig is None or sig.family == "OutOfMemoryError":  # MemoryGuard explains OOMs
        return None
    ctx = _context(guard)
    message, hint = _render(sig, exc, ctx)
    cls = getattr(_errors, sig.family)
    return cls(
        message.split("\n  fix: ")[0],
        rank=ctx.get("rank"),
        step=ctx.get("step"),
        hint=hint,
        signature=sig.key,
        original=f"{type(exc).__name__}: {_first_line(exc)}",
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _context(guard: Guard | None) -> dict[str, Any]:
    """What the guard knows, read defensively (it may be half started, or absent)."""
    if guard is None:
        return {}
    ctx: dict[str, Any] = {
        "rank": getattr(guard, "rank", None) if getattr(guard, "world_size", 1) > 1 else None,
        "step": getattr(guard, "step", None),
        "phase": getattr(guard, "phase", None),
        "world_size": getattr(guard, "world_size", 1),
    }
    # The call in flight (set by the auditor around a blocking collective), else the
    # auditor's most recent entry of the loop's own (not guardrails' agreements, which
    # the auditor records too). The auditor leaves guard.shared when it closes,
    # before this component's on_end: find it among the guard's components by name.
    collective = guard.shared.collective
    auditor = guard.shared.auditor or guard.component("audit")
    recent = getattr(auditor, "recent", None)
    if collective is None and recent:
        try:
            from guardrails.guards.audit.calls import entry_dict, is_own

            mine = [e for e in recent if not is_own(e)]
            collective = entry_dict(mine[-1]) if mine else None
        except Exception:  # another auditor version: say nothing rather than fail
            collective = None
    ctx["collective"] = collective
    return ctx


def _describe_collective(c: Any) -> str:
    if isinstance(c, dict):
        parts = [str(c.get("op", "?"))]
        if c.get("seq") is not None:
            parts.append(f"#{c['seq']}")
        if c.get("shapes") is not None:
            parts.append(f"shapes {c['shapes']}")
        if c.get("site"):
            parts.append(f"at {c['site']}")
        return " ".join(parts)
    return str(c)


def _render(sig: Signature, exc: BaseException, ctx: dict[str, Any]) -> tuple[str, str]:
    lines = [f"{sig.title} ({type(exc).__name__}: {_first_line(exc)})"]
    where = []
    if ctx.get("rank") is not None:
        where.append(f"rank {ctx['rank']} of {ctx.get('world_size')}")
    if ctx.get("step") is not None:
        where.append(f"after {ctx['step']} optimizer step(s)")
    if ctx.get("phase"):
        where.append(f"phase: {ctx['phase']}")
    if where:
        lines.append("  where: " + ", ".join(where))
    if ctx.get("collective") is not None:
        lines.append(f"  last collective: {_describe_collective(ctx['collective'])}")
    lines.append("  likely cause" + ("s:" if len(sig.causes) > 1 else ":"))
    lines += [f"    - {c}" for c in sig.causes]
    fix = sig.fix
    if sig.key == "address_in_use":
        port = _port(exc)
        fix = fix.format(port=port, next_port=port + 1)
        holders = _port_hint(port)
        if holders:
            fix = f"{holders} {fix}"
    return "\n".join(lines) + f"\n  fix: {fix}", fix


def _port(exc: BaseException) -> int:
    """The port in the error ("port: 29500" in torch's store error), else MASTER_PORT,
    else torchrun's default 29500."""
    import os

    m = re.search(r"port:? (\d{2,5})", str(exc))
    if m:
        return int(m.group(1))
    try:
        return int(os.environ.get("MASTER_PORT", "29500"))
    except ValueError:
        return 29500


def _port_hint(port: int) -> str:
    """Who holds ``port``, when this user can see it."""
    import os

    try:
        from guardrails.util.probes import port_holders

        holders = port_holders(port) or []
    except Exception:
        return ""
    if not holders:
        return ""
    named = "; ".join(
        f"pid {h['pid']} (this process)"
        if h.get("pid") == os.getpid()
        else f"pid {h['pid']} ({h.get('cmd') or '?'})"
        for h in holders
    )
    return f"Port {port} is held by {named}."


class ErrorExplainer(Component):
    """Re-raises a known torch / NCCL / gloo / CUDA error that ends the guarded loop as
    the guardrails error of its family, explained (see :func:`explain`); the original
    is its ``__cause__``. Out-of-memory errors are left to
    :class:`~guardrails.MemoryGuard`. No knobs: ``guardrails.guard(explain=False)``
    leaves it out."""

    @dataclass(kw_only=True)
    class Config:
        """ErrorExplainer has no knobs: the section only turns it on or off."""

    name = "explain"
    # First: its on_end runs last, so a component's own explanation (an OOM, a
    # collective mismatch, a hang) wins over the generic one (replace_error: the first
    # call wins).
    before = ("memory", "nan", "watchdog", "audit", "checkpoint")

    def __init__(self, config: ErrorExplainer.Config | None = None, /) -> None:
        self.config = config or ErrorExplainer.Config()

    def on_end(self, guard: Guard, exc: BaseException | None) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        error = translate(exc, guard)
        if error is not None:
            guard.replace_error(error)
