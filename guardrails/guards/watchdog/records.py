"""A rank's published watchdog record, read: where the rank is in words, whether it waits
inside a collective, how far it got.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardrails.distributed.dist import pid_alive
from guardrails.engine.model import ddp_wrapped
from guardrails.engine.where import (
    TORCH_DIR,
    is_user_file,
    parse_stack,
)
from guardrails.util.probes import stat_fields

if TYPE_CHECKING:
    from guardrails.engine.guard import Guard

# Heartbeats missed before a rank on another machine counts as gone: a thread that
# wakes every period misses 3 only when the process is dead or frozen holding the GIL.
STALE_PERIODS = 3


def main_thread_cpu_s() -> float | None:
    """CPU seconds the process's main thread has run (user + system), from Linux's
    ``/proc``; ``None`` elsewhere. The whole process's CPU would count the loader's
    workers, gloo's and NCCL's threads; this tells whether the training thread itself
    computes or waits."""
    import threading

    fields = stat_fields(f"/proc/self/task/{threading.main_thread().native_id}/stat")
    if fields is None:
        return None
    # utime and stime: fields 14 and 15 of stat(5), 11 and 12 after the comm.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: A main thread above this share of a core over the last sampled span computes; below
#: IDLE_CPU it is blocked (a sleep, a lock, I/O: ~0-1%). 0.25, not more: a computing
#: thread on a host with 4 runnable processes a core still gets a quarter of one. The
#: sampling (the kernel's 10 ms ticks over spans of 0.5 s or more) is exact to ~2%.
BUSY_CPU, IDLE_CPU = 0.25, 0.05


def activity(rec: dict[str, Any]) -> str:
    """A rank's main thread in words, from its record's ``cpu`` (its share of a core
    since its previous heartbeat): busy or idle, or ``""`` when not known."""
    cpu = rec.get("cpu")
    if cpu is None:
        return ""
    if cpu >= BUSY_CPU:
        gpu = " or spin-waiting for its GPU" if rec.get("device") == "cuda" else ""
        return (
            f"busy: its main thread ran {cpu:.0%} of a core over the last heartbeat "
            f"(computing{gpu}: slower than the timeout, not blocked)"
        )
    if cpu <= IDLE_CPU:
        return (
            f"idle: its main thread ran {cpu:.0%} of a core over the last heartbeat "
            "(blocked: a sleep, a lock, a read that never returns)"
        )
    return f"its main thread ran {cpu:.0%} of a core over the last heartbeat"


_PHASE_ORDER = {"setup": 0, "data": 1, "loop": 2, "forward": 3, "backward": 4, "optimizer": 5}


def _position(rec: dict[str, Any]) -> tuple[int, int]:
    """How far a rank got through its data: (pass over the loader, batches in it)."""
    return int(rec.get("epoch", 0)), int(rec.get("batches", 0))


def _past(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether position ``a`` is past ``b`` in the same pass over the data. A peer in a
    later pass also ran out of this one (it may just be quicker to start the next)."""
    return a[0] == b[0] and a[1] > b[1]


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _from_peer(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because of another rank
    (gloo: "Connection reset/closed by peer"; NCCL: a DistBackendError)."""
    import torch.distributed as dist

    text = str(exc).lower()
    if "address already in use" in text or "eaddrinuse" in text:
        return False  # this rank's own launch problem (the translator's LaunchError)
    if isinstance(exc, getattr(dist, "DistError", ())):  # DistBackendError, ... (torch 2.2+)
        return True
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "connection", "peer", "timed out", "broken pipe")
    )


def _own_failure(exc: BaseException | None) -> bool:
    """Whether a loop ended with an error of its own: not a collective a peer broke,
    not a stop (a signal's exit, Ctrl-C), not the end of its data."""
    return (
        isinstance(exc, Exception)
        and not _from_peer(exc)
        and not isinstance(exc.__cause__ or exc, StopIteration)
    )


def _host_id() -> str:
    """Hostname plus the PID namespace: two ranks may check each other's pids only when
    both match (containers on one host share a hostname but not pids)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    return f"{socket.gethostname()}|{ns}"


def _in_collective(rec: dict[str, Any]) -> bool:
    """Whether the rank is waiting on other ranks: inside a collective the auditor saw,
    or its innermost Python frame is in torch.distributed / DDP, or in autograd's
    backward (where DDP waits for its gradient all-reduce), or in a guardrails
    agreement between ranks (phase ``agree``: preflight's exchange through the store)."""
    if rec.get("collective") or rec.get("phase") == "agree":
        return True
    frames = parse_stack(rec.get("_stack", ""))
    if not frames:
        return False
    path = frames[-1][0]
    return path.startswith(TORCH_DIR) and any(
        part in path for part in (f"distributed{os.sep}", f"autograd{os.sep}")
    )


def _progress_key(rec: dict[str, Any]) -> tuple[int, int, int]:
    coll = rec.get("collective") or {}
    seq = coll.get("seq") if isinstance(coll, dict) else None
    return (
        int(rec.get("step", 0)),
        _PHASE_ORDER.get(str(rec.get("phase")), 0),
        int(seq) if isinstance(seq, int) else -1,
    )


def ddp_wrapped_models(guard: Guard) -> bool:
    """Whether a model of the guard is DDP's: a rank in its backward is then in the
    gradients' all-reduce (what a record's ``ddp`` says for :func:`_where`)."""
    return any(ddp_wrapped(m) for m in guard.models.values())


def _where(rec: dict[str, Any]) -> str:
    """Where a rank is, in words: the collective (op #seq at file:line), else the phase
    and the innermost frame of the user's code."""
    coll = rec.get("collective")
    if isinstance(coll, dict) and coll:
        # The auditor's entry (audit/calls.entry_dict): op, seq, group, shapes, dtype, site.
        op = coll.get("op", "a collective")
        seq = coll.get("seq")
        site = coll.get("site")
        what = [str(v) for v in (coll.get("shapes"), coll.get("dtype")) if v is not None]
        if coll.get("group") is not None:
            what.append(f"group {coll['group']}")
        text = f"in {op}" + (f" #{seq}" if seq is not None else "")
        if what:
            text += f" ({', '.join(what)})"
        return text + (f" at {site}" if site else "")
    phase = rec.get("phase")
    if rec.get("paused"):
        text = f"paused ({rec['paused']})"
    else:
        text = {
            "data": "in the loader's next()",
            "forward": "in the model's forward",
            "backward": "in backward, between forward and optimizer.step()"
            + (" (where DDP all-reduces the gradients)" if rec.get("ddp") else ""),
            "optimizer": "in optimizer.step()",
            "loop": "in the loop body",
            "setup": "before the first batch",
            "agree": "in a guardrails agreement with the other ranks (start checks, stop/save)",
        }.get(str(phase), f"in phase {phase}")
    frames = parse_stack(rec.get("_stack", ""))
    if frames:
        inner = frames[-1]
        user = [f for f in frames if is_user_file(f[0])]
        if inner[0].startswith(TORCH_DIR) and "distributed" in inner[0]:
            text = f"in torch.distributed {inner[2]}()"
        if user:
            path, num, func = user[-1]
            text += f" at {Path(path).name}:{num} ({func})"
    return text


# ---------------------------------------------------------------------- reading the store


def read_records(
    store: Any, kind: str, *, world: int, exclude: int | None = None
) -> dict[int, dict[str, Any]]:
    """Every rank's ``kind`` record (``hb``, ``end``) but ``exclude``'s, in at most three
    round trips to the store, whatever the number of ranks. Heartbeats: one ``check`` of all the
    keys, one ``multi_get`` (each key checked on its own only while some rank has
    not started its guard yet). End records: the list of ranks that ended, then
    just theirs."""
    if kind == "end":
        if not store.check(["ended"]):
            return {}
        listed = {int(r) for r in bytes(store.get("ended")).split()}
        ranks = sorted(listed - {exclude})
    else:
        ranks = [r for r in range(world) if r != exclude]
    keys = [f"{kind}/{r}" for r in ranks]
    if not keys:
        return {}
    # A rank lists itself as ended only after its record is set.
    whole = kind == "end" or store.check(keys)
    present = keys if whole else [k for k in keys if store.check([k])]
    if not present:
        return {}
    raw = store.multi_get(present)
    out: dict[int, dict[str, Any]] = {}
    for key, value in zip(present, raw, strict=True):
        out[int(key.rsplit("/", 1)[1])] = json.loads(bytes(value).decode())
    return out


def read_stacks(store: Any, ranks: list[int]) -> dict[int, str]:
    """The published stacks of ``ranks``: two round trips when all are there (the
    usual case: every live rank in a hang is suspect and publishes), else one
    ``check`` per key."""
    keys = [f"stack/{r}" for r in ranks]
    try:
        whole = bool(keys) and store.check(keys)
        present = keys if whole else [k for k in keys if store.check([k])]
        values = store.multi_get(present) if present else []
    except Exception:
        return {}
    return {
        int(k.rsplit("/", 1)[1]): bytes(v).decode() for k, v in zip(present, values, strict=True)
    }


def alive_here(rec: dict[str, Any] | None, host: str) -> bool | None:
    """Whether the process of the rank behind ``rec`` (a heartbeat or a live record) is
    alive, when it ran on this machine and pid namespace (``host``: :func:`_host_id`):
    exact, at once; ``None`` for a rank elsewhere, judged by its heartbeats instead."""
    if rec is None or rec.get("host") != host or not isinstance(rec.get("pid"), int):
        return None
    return pid_alive(rec["pid"])


def gone_here(rec: dict[str, Any] | None, host: str) -> bool:
    """Whether the process of the rank behind ``rec`` ran on this machine and is gone."""
    return alive_here(rec, host) is False


def last_seen(store: Any, r: int, live: dict[str, Any]) -> dict[str, Any]:
    """Rank ``r``'s record for a death its node's live record showed (``live.py``:
    ``gone_peers``): its first heartbeat (its log, its host; one key) with where the
    live record saw it last, a tick before it died. The collective is not in the live
    record: its phase says where."""
    key = f"hb/{r}"
    rec = json.loads(store.get(key)) if store.check([key]) else {}
    rec.update(rank=r, pid=live["pid"], host=live["host"], collective=None)
    rec.update(step=live.get("step"), phase=live.get("phase"), time=live.get("time"))
    return rec
