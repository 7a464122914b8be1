"""Launch checks: the job was started in a way that cannot work.

Several launch mistakes are reported late or cryptically by torch: ``CUDA error:
invalid device ordinal`` (``LOCAL_RANK`` past the GPUs this process sees, usually
``CUDA_VISIBLE_DEVICES`` fighting torchrun), ``Address already in use`` (a leftover
run holds ``MASTER_PORT``), a rendezvous that waits 30 minutes for a ``MASTER_ADDR``
nobody can reach, a ``WORLD_SIZE`` that does not match the ranks that came, or that a
hard-coded ``init_process_group(world_size=...)`` contradicts. Each check here turns
one of them into a :class:`~guardrails.LaunchError` naming the variable, its value and
the fix.

Where each check runs, and why there:

* **Before** ``main`` (``@guardrails.record`` calls :func:`check_before_main` first,
  before ``main`` can call ``init_process_group``): the environment's own consistency
  (integers; ``RANK`` < ``WORLD_SIZE``; ``LOCAL_RANK`` < ``LOCAL_WORLD_SIZE`` <=
  ``WORLD_SIZE``) and ``MASTER_ADDR`` (resolvable, not loopback on a node other than
  the first, routable from a worker). These read only the environment and the network
  and are wrong in every process that sees them. A problem is a ``LaunchError``: the
  decorated ``main`` exits 90 with the summary, before any rank waits at the rendezvous.
* **At guard start** in a distributed run (the preflight, once the process group
  exists): the same environment checks; ``WORLD_SIZE`` / ``RANK`` against the process
  group actually formed; across ranks, two ranks on one physical GPU (the preflight
  exchange, :mod:`guardrails.guards.preflight.preflight`).
* **Only when called** (:func:`check_launch`; ``python -m guardrails doctor`` shows the
  same facts): ``LOCAL_RANK`` against the visible GPUs and ``MASTER_PORT`` free on the
  rank that will host the store. ``@guardrails.record`` runs neither. Before ``main``
  the training device is unknown, and a gloo CPU job on a host with fewer GPUs than
  ranks is correct; at guard start the device is already chosen and works (one
  visible GPU per process with ``cuda:0`` is a correct setup). And before ``main`` the
  port can rightly be held by this job already (a sibling rank's store when ranks are
  started by ``torch.multiprocessing.spawn`` with an inherited environment, torchrun's
  agent, a launcher that hosts the store), which is exactly what a leftover run looks
  like; once the process group exists, our own store holds it. Call
  ``check_launch(device_type="cuda")`` before ``torch.cuda.set_device`` and
  ``init_process_group`` to run them.

Nothing here initialises CUDA: ``torch.cuda.device_count()`` asks NVML and creates no
context. Each probe is wrapped: a check that cannot run is skipped, never a crash.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("guardrails.launch")

DEFAULT_PORT = 29500  # init_process_group's and torchrun's default MASTER_PORT
#: A TCP connect to MASTER_ADDR is only a reachability probe: "no route" answers in
#: milliseconds; a silent firewall would take the whole timeout, so keep it short.
_CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class LaunchProblem:
    """One finding. ``level`` is ``"error"`` (the job cannot work) or ``"warning"``
    (probably a mistake, but a correct job can look like this)."""

    check: str
    level: str
    message: str
    fix: str

    def as_error(self, *, rank: int | None = None) -> Any:
        from guardrails._errors import LaunchError

        return LaunchError(self.message, check=self.check, hint=self.fix, rank=rank)


def check_launch(
    *,
    env: Mapping[str, str] | None = None,
    device_type: str | None = None,
    device_count: int | None = None,
    raise_errors: bool = True,
) -> list[LaunchProblem]:
    """Check how this process was launched; raise the first error as a
    :class:`~guardrails.LaunchError` (``raise_errors``), return every problem found.

    Args:
        env: the environment to read (default ``os.environ``).
        device_type: ``"cuda"`` when the job trains on GPUs, ``"cpu"`` when it does not,
            ``None`` when not known yet (device checks are then warnings: a gloo CPU job
            on a host that happens to have one GPU is fine).
        device_count: GPUs this process sees (default ``torch.cuda.device_count()``).
        raise_errors: raise the first ``"error"`` instead of returning it.
    """
    problems = launch_problems(env=env, device_type=device_type, device_count=device_count)
    return _report(problems, env, raise_errors=raise_errors)


def launch_problems(
    *,
    env: Mapping[str, str] | None = None,
    device_type: str | None = None,
    device_count: int | None = None,
    device_chosen: bool = False,
) -> list[LaunchProblem]:
    """Every check, never raising. See :func:`check_launch`. ``device_chosen``: the
    training device is already in use (guard start): LOCAL_RANK against the visible
    GPUs no longer matters (one visible GPU per process and cuda:0 is a correct setup),
    two ranks on one GPU is checked across ranks instead."""
    checks = [_env_consistency, _after_init, _devices, _master_port, _master_addr]
    if device_chosen:
        checks.remove(_devices)
    return _run_checks(checks, env, device_type, device_count)


def check_before_main(env: Mapping[str, str] | None = None) -> list[LaunchProblem]:
    """What ``@guardrails.record`` runs before ``main``: the checks that hold whatever
    the training device and however the ranks were started (see the module docstring:
    the environment's consistency and ``MASTER_ADDR``). Raises the first error as a
    :class:`~guardrails.LaunchError`; returns the problems (none are warnings today)."""
    problems = _run_checks([_env_consistency, _master_addr], env, None, None)
    return _report(problems, env, raise_errors=True)


def _run_checks(
    checks: list[Any],
    env: Mapping[str, str] | None,
    device_type: str | None,
    device_count: int | None,
) -> list[LaunchProblem]:
    env = dict(os.environ if env is None else env)
    problems: list[LaunchProblem] = []
    for check in checks:
        try:
            problems += check(env, device_type, device_count)
        except Exception:  # a probe's own bug must never stop a correct job
            logger.debug("guardrails: launch check %s failed", check.__name__, exc_info=True)
    return problems


def _report(
    problems: list[LaunchProblem], env: Mapping[str, str] | None, *, raise_errors: bool
) -> list[LaunchProblem]:
    """Log the warnings; raise the first error (``raise_errors``)."""
    for p in problems:
        if p.level == "warning":
            logger.warning("guardrails: %s\n  fix: %s", p.message, p.fix)
    errors = [p for p in problems if p.level == "error"]
    if errors and raise_errors:
        raise errors[0].as_error(rank=_int((os.environ if env is None else env).get("RANK")))
    return problems


# ---------------------------------------------------------------------------- checks


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _under_torchrun(env: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in env


def _env_consistency(env: dict[str, str], *_: Any) -> list[LaunchProblem]:
    out = []
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        if name in env and _int(env[name]) is None:
            out.append(
                LaunchProblem(
                    "env",
                    "error",
                    f"{name}={env[name]!r} is not an integer.",
                    f"set {name} to a number, or unset it and let torchrun set it.",
                )
            )
    rank, world = _int(env.get("RANK")), _int(env.get("WORLD_SIZE"))
    if rank is not None and world is not None and not 0 <= rank < world:
        out.append(
            LaunchProblem(
                "world_size",
                "error",
                f"RANK={rank} but WORLD_SIZE={world}: ranks go from 0 to WORLD_SIZE-1, so "
                "this process has no place in the job and the rendezvous would wait for "
                "it forever.",
                "launch with torchrun (it sets both), or give every process a distinct "
                f"RANK in 0..{max(world - 1, 0)} and the same WORLD_SIZE (nodes x "
                "processes per node).",
            )
        )
    local, local_world = _int(env.get("LOCAL_RANK")), _int(env.get("LOCAL_WORLD_SIZE"))
    if local is not None and local_world is not None and not 0 <= local < local_world:
        out.append(
            LaunchProblem(
                "local_rank",
                "error",
                f"LOCAL_RANK={local} but LOCAL_WORLD_SIZE={local_world}: the local rank must "
                "be below the number of processes on this node.",
                "let torchrun set LOCAL_RANK (--nproc_per_node=N), do not export it yourself.",
            )
        )
    if world is not None and local_world is not None and local_world > world:
        out.append(
            LaunchProblem(
                "world_size",
                "error",
                f"LOCAL_WORLD_SIZE={local_world} processes on this node but WORLD_SIZE={world} "
                "in the whole job.",
                "WORLD_SIZE must be nodes x --nproc_per_node; let torchrun compute it.",
            )
        )
    return out


def _after_init(env: dict[str, str], *_: Any) -> list[LaunchProblem]:
    """WORLD_SIZE / RANK against the process group that actually formed."""
    if not _initialized():
        return []
    import torch.distributed as dist

    out = []
    world, rank = _int(env.get("WORLD_SIZE")), _int(env.get("RANK"))
    if world is not None and world != dist.get_world_size():
        out.append(
            LaunchProblem(
                "world_size",
                "error",
                f"WORLD_SIZE={world} in the environment but the process group has "
                f"{dist.get_world_size()} ranks: init_process_group was given another "
                "world_size (often a hard-coded GPU count) than the launcher started.",
                "call init_process_group() without world_size/rank under torchrun (it reads "
                "them from the environment), or pass the launcher's values.",
            )
        )
    if rank is not None and rank != dist.get_rank():
        out.append(
            LaunchProblem(
                "world_size",
                "error",
                f"RANK={rank} in the environment but this process is rank "
                f"{dist.get_rank()} in the process group: two processes may have taken "
                "the same rank, or the rank was computed in code.",
                "call init_process_group() without rank= under torchrun, or pass "
                "int(os.environ['RANK']).",
            )
        )
    return out


def _visible(env: Mapping[str, str]) -> str:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    return "unset" if cvd is None else repr(cvd)


def _devices(
    env: dict[str, str], device_type: str | None, device_count: int | None
) -> list[LaunchProblem]:
    """LOCAL_RANK against the GPUs this process sees ("invalid device ordinal")."""
    if device_type not in (None, "cuda"):
        return []
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()  # NVML; creates no CUDA context
    local = _int(env.get("LOCAL_RANK"))
    local_world = _int(env.get("LOCAL_WORLD_SIZE"))
    level = "error" if device_type == "cuda" else "warning"
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    out = []
    if device_type == "cuda" and device_count == 0:
        return [
            LaunchProblem(
                "cuda_visible_devices",
                "error",
                f"this process sees no GPU (CUDA_VISIBLE_DEVICES={_visible(env)}) but the "
                "job trains on CUDA.",
                "unset CUDA_VISIBLE_DEVICES or list the GPUs this node should use; check "
                "`nvidia-smi` and `python -m guardrails doctor`.",
            )
        ]
    if device_count == 0 or local is None:
        return []
    if local >= device_count:
        per_process = cvd is not None and len([d for d in cvd.split(",") if d.strip()]) == 1
        cause = (
            "CUDA_VISIBLE_DEVICES is set per process to one GPU, so each process sees only "
            "cuda:0, while the code picks cuda:LOCAL_RANK"
            if per_process
            else "more processes were started on this node than GPUs are visible "
            "(--nproc_per_node larger than the GPUs in CUDA_VISIBLE_DEVICES)"
        )
        fix = (
            "either let torchrun assign GPUs (do not set CUDA_VISIBLE_DEVICES per process) "
            "and use torch.device('cuda', LOCAL_RANK), or keep one visible GPU per process "
            "and use cuda:0."
            if per_process
            else f"start at most {device_count} processes per node "
            f"(--nproc_per_node={device_count}), or list more GPUs in "
            "CUDA_VISIBLE_DEVICES (do not set CUDA_VISIBLE_DEVICES by hand unless you must: "
            "torchrun assigns the GPUs)."
        )
        out.append(
            LaunchProblem(
                "local_rank",
                level,
                f"LOCAL_RANK={local} but this process sees {device_count} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={_visible(env)}): torch.device('cuda', {local}) fails "
                f"with 'CUDA error: invalid device ordinal'. Cause: {cause}.",
                fix,
            )
        )
    elif local_world is not None and local_world > device_count and cvd is None:
        out.append(
            LaunchProblem(
                "local_rank",
                level,
                f"{local_world} processes on this node (LOCAL_WORLD_SIZE) but {device_count} "
                "GPU(s) visible: some ranks would share a GPU (NCCL refuses that: "
                "'Duplicate GPU detected').",
                f"use --nproc_per_node={device_count} (one process per GPU).",
            )
        )
    return out


def _master_port(env: dict[str, str], *_: Any) -> list[LaunchProblem]:
    """MASTER_PORT free on the host that will run the store. Only before the process
    group exists and outside torchrun: afterwards (or under torchrun's agent) the port
    is rightly held by our own job."""
    if _initialized() or _under_torchrun(env):
        return []
    port = _int(env.get("MASTER_PORT"))
    rank = _int(env.get("RANK")) or 0
    if port is None or rank != 0 or not _is_local(env.get("MASTER_ADDR", "localhost")):
        return []
    from guardrails.util.probes import port_status

    status = port_status(port)
    if status.get("status") != "in use":
        return []
    holders = status.get("holders") or []
    if holders:
        named = "; ".join(f"pid {h['pid']} ({h.get('cmd') or '?'})" for h in holders)
        who = f"held by {named}"
        kill = f"`kill {' '.join(str(h['pid']) for h in holders)}` if it is a leftover run"
    else:
        who = "held by a process this user cannot see"
        kill = f"find it with `lsof -i :{port}` and kill it if it is a leftover run"
    return [
        LaunchProblem(
            "master_port",
            "error",
            f"MASTER_PORT={port} is already in use on this host ({who}): the rendezvous "
            "store cannot listen there ('Address already in use'). Usually a previous "
            "training run that did not exit (a zombie process).",
            f"{kill}, or use another port: torchrun --master-port={port + 1} (or "
            f"MASTER_PORT={port + 1}).",
        )
    ]


def _master_addr(env: dict[str, str], *_: Any) -> list[LaunchProblem]:
    """MASTER_ADDR resolvable; not loopback on another node; routable from a worker."""
    if _initialized() or "MASTER_ADDR" not in env:
        return []
    addr = env["MASTER_ADDR"]
    try:
        infos = socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        return [
            LaunchProblem(
                "master_addr",
                "error",
                f"MASTER_ADDR={addr!r} does not resolve ({exc}): no rank can reach the "
                "rendezvous; the job would wait for the init timeout (30 min by default).",
                "set MASTER_ADDR to rank 0's IP address or a hostname every node resolves "
                "(torchrun --master-addr).",
            )
        ]
    node = _int(env.get("GROUP_RANK"))
    loopback = all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)
    if loopback and node is not None and node > 0:
        return [
            LaunchProblem(
                "master_addr",
                "error",
                f"MASTER_ADDR={addr!r} is a loopback address but this is node {node}: it "
                "points at this node, not at the node running rank 0.",
                "set MASTER_ADDR (torchrun --master-addr / --rdzv-endpoint) to rank 0's "
                "network address.",
            )
        ]
    port = _int(env.get("MASTER_PORT")) or DEFAULT_PORT
    if loopback or (_int(env.get("RANK")) or 0) == 0:
        return []
    # A worker: rank 0's store may not listen yet (refused / timeout prove nothing),
    # but "no route to host" / "network unreachable" do.
    with contextlib.closing(socket.socket(infos[0][0], socket.SOCK_STREAM)) as s:
        s.settimeout(_CONNECT_TIMEOUT_S)
        code = s.connect_ex(infos[0][4][:2])
    if code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return [
            LaunchProblem(
                "master_addr",
                "error",
                f"MASTER_ADDR={addr!r} is unreachable from this host ({os.strerror(code)}, "
                f"port {port}).",
                "check the address and the network between nodes; with several interfaces "
                "pin the right one (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME).",
            )
        ]
    return []


def _is_local(addr: str) -> bool:
    """Whether ``addr`` names this host (loopback, its hostname, or one of its IPs)."""
    if addr in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        ips = {i[4][0] for i in socket.getaddrinfo(addr, None)}
    except OSError:
        return False
    if any(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips):
        return True
    mine: set[str] = set()
    with contextlib.suppress(OSError):
        mine = {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None)}
    return bool(ips & mine)
