"""Environment variables that make a distributed job slow, hang or fail, as a table.

People set ``NCCL_*``, ``TORCH_*`` and ``CUDA_*`` variables while debugging (from forum
answers, old scripts, a colleague's shell) and forget them: ``NCCL_P2P_DISABLE=1`` sends
every intra-node all-reduce through host memory, ``CUDA_LAUNCH_BLOCKING=1`` makes every
kernel launch synchronous, ``NCCL_IB_TIMEOUT=1000`` is not seconds but an out-of-range
exponent, ``PYTHONGC_THRESHOLD`` and ``CUDA_MEMORY_FRACTION`` are read by nothing at all.
``python -m guardrails doctor`` lists each such setting with what it does and the fix.

Each row of :data:`ENV_RULES` is data: the variable the finding names, its level
(``"bad"``: will hurt, ``"warn"``: probably not what you want, ``"info"``: advice), when
it applies (a predicate over :class:`EnvView`, the environment with the numbers the
rules share already parsed), what the setting means and the fix. The two texts are
``str.format`` templates over ``e`` (the :class:`EnvView`), ``name`` and ``value`` (the
variable's raw value); :func:`env_flags` evaluates the rows in order and returns one
finding per row that applies, its message the meaning and the fix joined by a space.
A rule whose level or text depends on the job (``NCCL_IB_DISABLE`` is harmless on one
node, bad across nodes) is two rows with exclusive conditions.

NCCL and CUDA settings mean nothing to a CPU-only build of torch: there the rows about
them are not evaluated and the variables set are named once, as having no effect. Advice
for debugging GPU jobs (set ``NCCL_DEBUG``) is given only where torch sees a GPU.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property

from guardrails.util.probes import usable_cpus


def flag(level: str, name: str, message: str) -> dict[str, str]:
    """One finding as doctor reports it. ``level``: "bad" (will hurt), "warn" (probably
    not what you want), "info" (advice)."""
    return {"level": level, "name": name, "message": message}


def _as_int(v: str | None) -> int | None:
    try:
        return None if v is None else int(v)
    except ValueError:
        return None


_OFF = ("", "0", "false", "no", "off")
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


class EnvView:
    """The environment as the rules read it: raw values plus the parsed numbers several
    rules share. Properties are computed on first use (the interface list and the CPU
    affinity only when a rule asks)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.env.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.env

    def is_on(self, name: str) -> bool:
        """Set to something other than empty, 0, false, no or off."""
        return name in self.env and self.env[name].strip().lower() not in _OFF

    @cached_property
    def world(self) -> int:
        return _as_int(self.env.get("WORLD_SIZE")) or 1

    @cached_property
    def local_world(self) -> int:
        return _as_int(self.env.get("LOCAL_WORLD_SIZE")) or 1

    @property
    def multi_node(self) -> bool:
        return self.world > self.local_world

    @cached_property
    def under_torchrun(self) -> bool:
        return "TORCHELASTIC_RUN_ID" in self.env or "LOCAL_RANK" in self.env

    @cached_property
    def local_rank(self) -> int | None:
        return _as_int(self.env.get("LOCAL_RANK"))

    @cached_property
    def nccl_debug(self) -> str:
        return self.env.get("NCCL_DEBUG", "").upper()

    @cached_property
    def ib_timeout(self) -> int | None:
        return _as_int(self.env.get("NCCL_IB_TIMEOUT"))

    @cached_property
    def visible(self) -> list[str] | None:
        """CUDA_VISIBLE_DEVICES as a list of entries; None when unset."""
        cvd = self.env.get("CUDA_VISIBLE_DEVICES")
        return None if cvd is None else [d for d in cvd.split(",") if d.strip()]

    @property
    def n_visible(self) -> int:
        return len(self.visible or [])

    @cached_property
    def omp(self) -> int | None:
        return _as_int(self.env.get("OMP_NUM_THREADS"))

    @property
    def omp_threads(self) -> int:
        return (self.omp or 0) * self.local_world

    @cached_property
    def cpus(self) -> int | None:
        return usable_cpus()

    @property
    def omp_fit(self) -> int:
        """OMP_NUM_THREADS that gives each rank on this node its share of the CPUs."""
        return max(1, (self.cpus or 1) // self.local_world)

    @cached_property
    def interfaces(self) -> list[str] | None:
        """This host's network interfaces; None when they cannot be listed."""
        try:
            return [n for _, n in socket.if_nameindex()]
        except OSError:
            return None

    def ifname_match(self, name: str) -> list[str] | None:
        """The interfaces ``name`` (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME) selects. NCCL
        and gloo take a comma list of prefixes (``=eth0`` exact, ``^docker`` excluded).
        None when unset or not checkable (no interface list, an exclusion list)."""
        value = self.env.get(name)
        if not value or self.interfaces is None:
            return None
        wanted = [v.strip() for v in value.split(",") if v.strip()]
        if wanted and wanted[0].startswith("^"):
            return None
        exact = bool(wanted) and wanted[0].startswith("=")
        wanted = [w.lstrip("=") for w in wanted]
        return [
            n
            for n in self.interfaces
            if any((n == w) if exact else n.startswith(w) for w in wanted)
        ]

    def ifname_wireless(self, name: str) -> bool:
        match = self.ifname_match(name)
        return bool(match) and all(n.startswith(("wl", "wlan")) for n in match)

    @property
    def interface_list(self) -> str:
        return ", ".join(self.interfaces or [])


#: Variables read only by CUDA and NCCL (and torch's CUDA allocator): inert without them.
GPU_ONLY = ("NCCL_", "TORCH_NCCL_", "CUDA_", "PYTORCH_CUDA_")


@dataclass(frozen=True)
class EnvRule:
    """One row: the variable named, its level, when it applies, what it means, the fix.
    ``advice``: a suggestion for debugging GPU jobs, not a finding about a setting."""

    name: str
    level: str
    when: Callable[[EnvView], bool]
    means: str
    fix: str = ""
    advice: bool = False

    @property
    def gpu_only(self) -> bool:
        return self.name.startswith(GPU_ONLY)

    def message(self, e: EnvView) -> str:
        text = f"{self.means} {self.fix}" if self.fix else self.means
        return text.format(e=e, name=self.name, value=e.get(self.name, ""))


def _async_error_handling_off(e: EnvView) -> bool:
    value = e.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", e.get("NCCL_ASYNC_ERROR_HANDLING"))
    return value is not None and value.strip() == "0"


def _blocking_wait_on(e: EnvView) -> bool:
    value = e.get("TORCH_NCCL_BLOCKING_WAIT", e.get("NCCL_BLOCKING_WAIT"))
    return value is not None and value.strip() not in ("", "0")


_IB_OFF = (
    "InfiniBand / RoCE is off, so traffic between nodes goes over TCP sockets (a common "
    "workaround for a broken IB network)."
)
_NOT_READ = (
    "is not read by Python or PyTorch (tuning advice recommends it, but nothing looks at it): "
    "it does nothing."
)

#: The rules, in the order doctor lists their findings.
ENV_RULES: tuple[EnvRule, ...] = (
    EnvRule(
        "NCCL_P2P_DISABLE",
        "bad",
        lambda e: e.is_on("NCCL_P2P_DISABLE"),
        "GPU peer-to-peer (NVLink / PCIe P2P) is off: every intra-node all-reduce goes "
        "through host memory, several times slower.",
        "A workaround for broken P2P (some consumer cards, VMs, IOMMU); unset it unless that "
        "is your case, and check the links with `nvidia-smi topo -m`.",
    ),
    EnvRule(
        "NCCL_SHM_DISABLE",
        "warn",
        lambda e: e.is_on("NCCL_SHM_DISABLE"),
        "shared-memory transport is off: intra-node traffic without P2P falls back to sockets.",
        "Unset it unless /dev/shm is too small (in Docker: --shm-size).",
    ),
    EnvRule(
        "NCCL_IB_DISABLE",
        "bad",
        lambda e: e.is_on("NCCL_IB_DISABLE") and e.multi_node,
        f"{_IB_OFF} This job spans nodes: expect much slower all-reduces;",
        "unset it unless IB is broken on this cluster.",
    ),
    EnvRule(
        "NCCL_IB_DISABLE",
        "info",
        lambda e: e.is_on("NCCL_IB_DISABLE") and not e.multi_node,
        f"{_IB_OFF} Harmless on one node;",
        "do not carry it to multi-node jobs.",
    ),
    EnvRule(
        "NCCL_IB_TIMEOUT",
        "bad",
        lambda e: e.ib_timeout is not None and not 1 <= e.ib_timeout <= 31,
        "={e.ib_timeout} is out of range: it is an exponent (timeout = 4.096 us x 2^value, "
        "NCCL's default 20, about 4 s), valid 1-31; it is not a number of seconds (1000 "
        "does not mean 1000 s).",
        "Use 22-23 for large or lossy fabrics. It is not the collective timeout either: that "
        "is init_process_group(timeout=...).",
    ),
    EnvRule(
        "NCCL_DEBUG",
        "info",
        lambda e: not e.nccl_debug,
        "unset.",
        "When debugging a hang or an NCCL error, set NCCL_DEBUG=INFO (and "
        "NCCL_DEBUG_SUBSYS=INIT,COLL,NET to focus): NCCL then logs which transport, "
        "interface and ring it chose.",
        advice=True,
    ),
    EnvRule(
        "NCCL_DEBUG",
        "warn",
        lambda e: e.nccl_debug == "TRACE",
        "=TRACE logs every collective call: slow and huge logs.",
        "Use INFO, or unset it outside debugging.",
    ),
    EnvRule(
        "NCCL_DEBUG_SUBSYS",
        "warn",
        lambda e: bool(e.get("NCCL_DEBUG_SUBSYS")) and not e.nccl_debug,
        "has no effect without NCCL_DEBUG",
        "(set NCCL_DEBUG=INFO as well).",
    ),
    EnvRule(
        "TORCH_DISTRIBUTED_DEBUG",
        "warn",
        lambda e: (e.get("TORCH_DISTRIBUTED_DEBUG") or "").upper() == "DETAIL",
        "=DETAIL checks every collective against the other ranks (an extra collective each "
        "time) and logs DDP internals: a debugging aid for collective mismatches that slows "
        "training.",
        "Unset it in production runs.",
    ),
    *(
        EnvRule(
            old,
            "info",
            lambda e, old=old: e.has(old) and not e.has(f"TORCH_{old}"),
            f"is the old name of TORCH_{old} (torch >= 2.2 reads both, and warns).",
            "Rename it.",
        )
        for old in ("NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_DESYNC_DEBUG")
    ),
    EnvRule(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "bad",
        _async_error_handling_off,
        "=0 turns off NCCL error handling: a failed or timed-out collective is not acted on, "
        "so the other ranks hang instead of the job failing.",
        "Unset it (torch's default tears the process down so torchrun can restart the job).",
    ),
    EnvRule(
        "TORCH_NCCL_BLOCKING_WAIT",
        "warn",
        _blocking_wait_on,
        "=1 makes the host block in every collective's wait() until it finishes (and raise "
        "there on timeout): host and device no longer overlap.",
        "Not needed for timeouts (async error handling already aborts); a debugging aid only.",
    ),
    EnvRule(
        "CUDA_LAUNCH_BLOCKING",
        "bad",
        lambda e: e.is_on("CUDA_LAUNCH_BLOCKING"),
        "=1 makes every CUDA kernel launch synchronous: several times slower.",
        "It is for locating a CUDA error's true line; unset it afterwards.",
    ),
    EnvRule(
        "PYTHONGC_THRESHOLD",
        "bad",
        lambda e: e.has("PYTHONGC_THRESHOLD"),
        _NOT_READ,
        'Use gc.set_threshold(...) in code, or guard(gc={{"every_n_steps": ...}}).',
    ),
    EnvRule(
        "CUDA_MEMORY_FRACTION",
        "bad",
        lambda e: e.has("CUDA_MEMORY_FRACTION"),
        _NOT_READ,
        "Use torch.cuda.set_per_process_memory_fraction(0.9).",
    ),
    EnvRule(
        "CUDA_VISIBLE_DEVICES",
        "warn",
        lambda e: e.visible == [],
        "is set but empty: it hides every GPU from this process.",
        "Unset it to use the GPUs.",
    ),
    EnvRule(
        "CUDA_VISIBLE_DEVICES",
        "bad",
        lambda e: bool(e.visible) and e.local_rank is not None and e.local_rank >= e.n_visible,
        "={value} shows {e.n_visible} device(s) but LOCAL_RANK is {e.local_rank}: "
        "torch.cuda.set_device({e.local_rank}) fails with 'invalid device ordinal'.",
        "Let torchrun assign the GPUs (no per-process CUDA_VISIBLE_DEVICES); to "
        "restrict them, set it once for the whole torchrun command, covering nproc_per_node "
        "devices.",
    ),
    EnvRule(
        "CUDA_VISIBLE_DEVICES",
        "warn",
        lambda e: (
            bool(e.visible)
            and not (e.local_rank is not None and e.local_rank >= e.n_visible)
            and e.under_torchrun
            and e.n_visible < e.local_world
        ),
        "={value} shows fewer devices ({e.n_visible}) than ranks on this node "
        "({e.local_world}): ranks will share a GPU or fail with 'invalid device ordinal'.",
    ),
    EnvRule(
        "MASTER_ADDR",
        "bad",
        lambda e: e.multi_node and e.get("MASTER_ADDR", "") in _LOOPBACK,
        "={value} but the job spans nodes (WORLD_SIZE {e.world}, {e.local_world} per node): "
        "the other nodes cannot reach it and hang at init.",
        "Use the master node's routable address.",
    ),
    *(
        rule
        for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
        for rule in (
            EnvRule(
                var,
                "bad",
                lambda e, var=var: e.ifname_match(var) == [],
                "={value} matches no network interface on this host ({e.interface_list}): "
                "the rendezvous cannot connect and hangs.",
                "Use one of those (`ip -br addr` shows which carries the cluster's network).",
            ),
            EnvRule(
                var,
                "warn",
                lambda e, var=var: e.ifname_wireless(var),
                "={value} is a wireless interface: every step's gradient all-reduce crosses it "
                "and will dominate the step time.",
                "Use a wired link.",
            ),
        )
    ),
    EnvRule(
        "OMP_NUM_THREADS",
        "warn",
        lambda e: e.omp is not None and bool(e.cpus) and e.omp_threads > (e.cpus or 0),
        "={e.omp} x {e.local_world} rank(s) on this node = {e.omp_threads} threads for "
        "{e.cpus} usable CPUs: oversubscribed, CPU ops and the data loader slow down.",
        "Use OMP_NUM_THREADS={e.omp_fit}.",
    ),
)


def env_flags(
    env: Mapping[str, str], *, cuda_build: bool = True, gpu_visible: bool = True
) -> list[dict[str, str]]:
    """Known-bad settings in ``env``: one finding per rule of :data:`ENV_RULES` that
    applies, in the table's order. ``cuda_build``: torch was built with CUDA (or ROCm);
    without it, the NCCL / CUDA rows give way to one note naming the variables set.
    ``gpu_visible``: torch sees a GPU; without it, no GPU debugging advice."""
    e = EnvView(env)
    found = [
        flag(r.level, r.name, r.message(e))
        for r in ENV_RULES
        if (cuda_build or not r.gpu_only) and (gpu_visible or not r.advice) and r.when(e)
    ]
    inert = sorted(n for n in env if n.startswith(GPU_ONLY))
    if not cuda_build and inert:
        found.append(
            flag(
                "info",
                "NCCL / CUDA settings",
                f"{', '.join(inert)} {'is' if len(inert) == 1 else 'are'} set, but this torch "
                "is a CPU-only build (no CUDA, no NCCL): no effect here. Run doctor on the "
                "GPU machines to check them there.",
            )
        )
    return found
