"""``python -m guardrails doctor``: the seeds' "quick diagnostic script", as one command.

Seed 000 ends with a shell script users paste by hand (``nvidia-smi``, ``topo -m``, the
compute processes, ``env | grep NCCL``, torch's versions); seed 002's tables list the
environment variables people set while debugging, several of which make things worse
when left on; seed 004's two-node hang was a bf16 run on a CPU without native bf16 and
ranks that saw different data directories. Doctor gathers all of that in one screen:

* versions: torch, CUDA, cuDNN, NCCL, Python; backends available;
* GPUs through NVML (the optional ``nvml`` extra: ``nvidia-ml-py``), else by parsing
  ``nvidia-smi --query-gpu``, else a plain "no GPU" line saying why; throttling
  (clock vs max and the driver's throttle reasons), temperature, ECC errors;
  the topology (``nvidia-smi topo -m``) and the processes holding GPU memory;
* the distributed environment (``NCCL_*``, ``GLOO_*``, ``TORCH_*``, ``MASTER_*``, ...)
  with known-bad settings flagged, each with why and what to do;
* CPU: bf16 support (``avx512_bf16`` / ``amx_bf16``), cores, threads;
* the rendezvous port (29500, and ``MASTER_PORT``): free, or which process holds it.

Under ``torchrun`` every rank collects its report, they are gathered over a gloo group
(``all_gather_object``: a few KB, once) and rank 0 prints its own report plus the
differences between ranks. Every probe is wrapped: a missing tool or library is
reported as unavailable, never a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("guardrails")

DEFAULT_PORT = 29500  # torchrun's and init_process_group's default MASTER_PORT
_TOOL_TIMEOUT_S = 15.0  # nvidia-smi can take seconds on a busy 8-GPU node; never hang on it

#: Variables shown (and compared between ranks): prefixes, then exact names.
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "MASTER_", "PYTORCH_")
ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_MEMORY_FRACTION",
    "OMP_NUM_THREADS",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "PYTHONGC_THRESHOLD",
)
#: Set per rank or per launch by torchrun: their differences between ranks are expected.
PER_RANK = {
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_WORKER_GROUP_ID",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING_TMP",
}
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIAL|AUTH", re.I)

# nvidia-smi fields: (query name, our key). Optional ones are retried without on error
# (older drivers lack some; clocks_throttle_reasons was renamed clocks_event_reasons).
_SMI_FIELDS = [
    ("index", "index"),
    ("name", "name"),
    ("memory.total", "memory_total_mib"),
    ("memory.used", "memory_used_mib"),
    ("utilization.gpu", "util_pct"),
    ("temperature.gpu", "temp_c"),
    ("clocks.sm", "sm_clock_mhz"),
    ("clocks.max.sm", "sm_clock_max_mhz"),
    ("power.draw", "power_w"),
    ("power.limit", "power_limit_w"),
]
_SMI_OPTIONAL = [
    ("ecc.errors.uncorrected.volatile.total", "ecc_uncorrected"),
    ("ecc.errors.corrected.volatile.total", "ecc_corrected"),
    ("clocks_throttle_reasons.active", "throttle_reasons"),
]
# NVML throttle-reason bits that mean "slowed down against the user's will" (idle, app
# clock settings and sync boost are not). Values from nvml.h.
_THROTTLE_BITS = {
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
_HOT_C = 85  # datacenter GPUs start slowing down around 85-90 C


# ---------------------------------------------------------------------------- collect


def collect() -> dict[str, Any]:
    """This process's report: a JSON-able dict. Never raises for a missing tool."""
    report: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": _int_env("RANK"),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
    }
    for key, probe in (
        ("versions", _versions),
        ("gpus", _gpus),
        ("topology", _topology),
        ("cpu", _cpu),
        ("ports", _ports),
    ):
        try:
            report[key] = probe()
        except Exception as exc:  # a probe bug must not hide the rest of the report
            report[key] = {"error": f"{type(exc).__name__}: {exc}"}
    env = {k: v for k, v in os.environ.items() if _relevant(k)}
    report["env"] = {k: _redact(k, v) for k, v in sorted(env.items())}
    report["flags"] = env_flags(dict(os.environ))
    report["flags"] += _gpu_flags(report.get("gpus", {}))
    report["flags"] += _cpu_flags(report.get("cpu", {}))
    return report


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _relevant(name: str) -> bool:
    return name.startswith(ENV_PREFIXES) or name in ENV_NAMES


def _redact(name: str, value: str) -> str:
    return "<redacted>" if _SECRET.search(name) else value


def _run(cmd: list[str]) -> tuple[int | None, str]:
    """(returncode, stdout+stderr); returncode None when the tool is missing or hung."""
    if shutil.which(cmd[0]) is None:
        return None, f"{cmd[0]} not found on PATH"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(cmd)} did not answer in {_TOOL_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, f"{cmd[0]}: {exc}"
    return p.returncode, (p.stdout + p.stderr).strip()


def _versions() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # None: a CPU build
        "cudnn": None,
        "nccl": None,
        "cuda_available": False,
        "cuda_devices": 0,
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl_backend": dist.is_available() and dist.is_nccl_available(),
    }
    with contextlib.suppress(Exception):
        out["cudnn"] = torch.backends.cudnn.version()
    with contextlib.suppress(Exception):
        if torch.version.cuda is not None:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    try:
        # is_available() and device_count() use NVML when it can and do not create a
        # CUDA context: doctor holds no GPU memory.
        out["cuda_available"] = torch.cuda.is_available()
        out["cuda_devices"] = torch.cuda.device_count()
    except Exception as exc:
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _gpus() -> dict[str, Any]:
    """GPUs and the processes holding their memory: NVML, else nvidia-smi."""
    why: list[str] = []
    try:
        return _gpus_nvml()
    except ImportError:
        why.append('NVML bindings not installed (pip install "torch-guardrails[nvml]")')
    except Exception as exc:
        why.append(f"NVML: {type(exc).__name__}: {exc}".strip())
    try:
        return _gpus_smi()
    except Exception as exc:
        why.append(str(exc))
    return {"source": None, "devices": [], "processes": [], "why": "; ".join(why)}


def _gpus_nvml() -> dict[str, Any]:
    import pynvml as nv  # the nvml extra: nvidia-ml-py

    nv.nvmlInit()
    try:
        devices, processes = [], []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            d: dict[str, Any] = {"index": i}

            def get(key: str, fn: Any, *args: Any, _d: dict[str, Any] = d) -> Any:
                try:
                    val = fn(*args)
                except Exception:  # NVMLError_NotSupported on some boards: leave it out
                    val = None
                _d[key] = val.decode() if isinstance(val, bytes) else val
                return _d[key]

            get("name", nv.nvmlDeviceGetName, h)
            mem = get("_mem", nv.nvmlDeviceGetMemoryInfo, h)
            d.pop("_mem")
            if mem is not None:
                d["memory_total_mib"] = mem.total / 2**20
                d["memory_used_mib"] = mem.used / 2**20
            util = get("_util", nv.nvmlDeviceGetUtilizationRates, h)
            d.pop("_util")
            d["util_pct"] = None if util is None else util.gpu
            get("temp_c", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            get("sm_clock_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            get("sm_clock_max_mhz", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
            power = get("power_w", nv.nvmlDeviceGetPowerUsage, h)
            d["power_w"] = None if power is None else power / 1000
            limit = get("power_limit_w", nv.nvmlDeviceGetEnforcedPowerLimit, h)
            d["power_limit_w"] = None if limit is None else limit / 1000
            reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
                nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
            )
            if reasons is not None:
                get("throttle_reasons", reasons, h)
            for key, kind in (("ecc_uncorrected", 1), ("ecc_corrected", 0)):
                # kind: NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1; counter: VOLATILE_ECC = 0
                get(key, nv.nvmlDeviceGetTotalEccErrors, h, kind, 0)
            devices.append(d)
            procs: list[Any] = []
            with contextlib.suppress(Exception):
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                processes.append(
                    {
                        "gpu": i,
                        "pid": p.pid,
                        "name": _cmdline(p.pid) or "?",
                        "used_mib": None if used is None else used / 2**20,
                    }
                )
        return {"source": "nvml", "devices": devices, "processes": processes}
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()


def _num(text: str) -> float | int | str | None:
    text = text.strip()
    if not text or text.startswith("[") or text in ("N/A", "[N/A]", "Not Supported"):
        return None
    try:
        if text.lower().startswith("0x"):
            return int(text, 16)
        f = float(text)
        return int(f) if f.is_integer() else f
    except ValueError:
        return text


def _gpus_smi() -> dict[str, Any]:
    fields = _SMI_FIELDS + _SMI_OPTIONAL
    code, out = _run(["nvidia-smi", f"--query-gpu={','.join(f for f, _ in fields)}", _CSV])
    if code not in (None, 0):
        fields = _SMI_FIELDS
        code, out = _run(["nvidia-smi", f"--query-gpu={','.join(f for f, _ in fields)}", _CSV])
    if code is None:
        raise RuntimeError(out)
    if code != 0:
        # "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
        raise RuntimeError(f"nvidia-smi failed (exit {code}): {out.splitlines()[0] if out else ''}")
    devices = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            continue
        d = {key: _num(c) for (_, key), c in zip(fields, cells, strict=True)}
        d["name"] = cells[1]
        devices.append(d)
    processes = []
    code, out = _run(
        ["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid,process_name,used_memory", _CSV]
    )
    if code == 0:
        for line in out.splitlines():
            cells = [c.strip() for c in line.split(",")]
            if len(cells) == 4 and cells[1].isdigit():
                pid = int(cells[1])
                processes.append(
                    {
                        "gpu": cells[0],
                        "pid": pid,
                        "name": _cmdline(pid) or cells[2],
                        "used_mib": _num(cells[3]),
                    }
                )
    return {"source": "nvidia-smi", "devices": devices, "processes": processes}


_CSV = "--format=csv,noheader,nounits"


def _topology() -> dict[str, Any]:
    code, out = _run(["nvidia-smi", "topo", "-m"])
    # nvidia-smi underlines the header with ANSI escapes even into a pipe (seen on an
    # H200 host): strip them, they garble logs and JSON.
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)
    if code == 0:
        return {"matrix": out}
    return {"matrix": None, "why": out or f"nvidia-smi topo -m exited {code}"}


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or None


def _cpu() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "model": platform.processor() or platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "capability": None,
        "avx512_bf16": None,
        "amx_bf16": None,
    }
    with contextlib.suppress(Exception):
        out["capability"] = torch.backends.cpu.get_cpu_capability()
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                out["model"] = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
                break
    if flags:
        out["avx512_bf16"] = "avx512_bf16" in flags
        out["amx_bf16"] = "amx_bf16" in flags
    else:  # not Linux: ask torch (private helpers, present since torch 2.1)
        with contextlib.suppress(Exception):
            out["avx512_bf16"] = bool(torch.cpu._is_avx512_bf16_supported())
        with contextlib.suppress(Exception):
            out["amx_bf16"] = bool(torch.cpu._is_amx_tile_supported())
    out["bf16_native"] = bool(out["avx512_bf16"] or out["amx_bf16"])
    return out


def _ports() -> list[dict[str, Any]]:
    ports = [DEFAULT_PORT]
    master = _int_env("MASTER_PORT")
    if master is not None and master != DEFAULT_PORT:
        ports.append(master)
    return [_port_status(p) for p in ports]


def _port_status(port: int) -> dict[str, Any]:
    """Try to bind the port the way TCPStore does (SO_REUSEADDR); name the holder."""
    out: dict[str, Any] = {"port": port, "master_port": _int_env("MASTER_PORT") == port}
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
        out["status"] = "free"
        return out
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            out["status"] = f"unknown ({exc})"
            return out
        out["status"] = "in use"
    finally:
        s.close()
    out["holders"] = _port_holders(port)
    return out


def _port_holders(port: int) -> list[dict[str, Any]] | None:
    """Processes with a listening socket on ``port``: /proc/net/tcp{,6} gives the socket
    inodes, /proc/<pid>/fd the owners. None when the owners cannot be seen (another
    user's processes, or no /proc)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                # local_address is HEXIP:HEXPORT; state 0A is LISTEN
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    if not inodes:
        return None
    holders = []
    # Under torchrun, MASTER_PORT is held by the launcher (an ancestor): expected.
    ancestors = _ancestors() if "TORCHELASTIC_RUN_ID" in os.environ else set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                pid = int(proc.name)
                holders.append({"pid": pid, "cmd": _cmdline(pid), "ours": pid in ancestors})
                break
    return holders or None


def _ancestors() -> set[int]:
    """This process and its parents (a torchrun agent holding MASTER_PORT is ours)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


# ---------------------------------------------------------------------------- flags


def _flag(level: str, name: str, message: str) -> dict[str, str]:
    """level: "bad" (will hurt), "warn" (probably not what you want), "info" (advice)."""
    return {"level": level, "name": name, "message": message}


def env_flags(env: dict[str, str]) -> list[dict[str, str]]:
    """Known-bad settings in ``env`` (seed 002's tables and what they leave out)."""
    flags = []
    on = {k for k, v in env.items() if v.strip().lower() not in ("", "0", "false", "no", "off")}
    under_torchrun = "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env
    world = _as_int(env.get("WORLD_SIZE")) or 1
    local_world = _as_int(env.get("LOCAL_WORLD_SIZE")) or 1

    if "NCCL_P2P_DISABLE" in on:
        flags.append(
            _flag(
                "bad",
                "NCCL_P2P_DISABLE",
                "GPU peer-to-peer (NVLink / PCIe P2P) is off: every intra-node all-reduce goes "
                "through host memory, several times slower. A workaround for broken P2P "
                "(some consumer cards, VMs, IOMMU); unset it unless that is your case, and "
                "check the links with `nvidia-smi topo -m`.",
            )
        )
    if "NCCL_SHM_DISABLE" in on:
        flags.append(
            _flag(
                "warn",
                "NCCL_SHM_DISABLE",
                "shared-memory transport is off: intra-node traffic without P2P falls back "
                "to sockets. Unset it unless /dev/shm is too small (in Docker: --shm-size).",
            )
        )
    if "NCCL_IB_DISABLE" in on:
        level = "bad" if world > local_world else "info"
        flags.append(
            _flag(
                level,
                "NCCL_IB_DISABLE",
                "InfiniBand / RoCE is off, so traffic between nodes goes over TCP sockets "
                "(a common workaround for a broken IB network). "
                + (
                    "This job spans nodes: expect much slower all-reduces; unset it unless "
                    "IB is broken on this cluster."
                    if level == "bad"
                    else "Harmless on one node; do not carry it to multi-node jobs."
                ),
            )
        )
    ib_timeout = _as_int(env.get("NCCL_IB_TIMEOUT"))
    if ib_timeout is not None and not 1 <= ib_timeout <= 31:
        flags.append(
            _flag(
                "bad",
                "NCCL_IB_TIMEOUT",
                f"={ib_timeout} is out of range: it is an exponent (timeout = 4.096 us x "
                "2^value, NCCL's default 20, about 4 s), valid 1-31; seed 002's 1000 is not "
                "a number of seconds. Use 22-23 for large or lossy fabrics. It is not the "
                "collective timeout either: that is init_process_group(timeout=...).",
            )
        )
    debug = env.get("NCCL_DEBUG", "").upper()
    if not debug:
        flags.append(
            _flag(
                "info",
                "NCCL_DEBUG",
                "unset. When debugging a hang or an NCCL error, set NCCL_DEBUG=INFO (and "
                "NCCL_DEBUG_SUBSYS=INIT,COLL,NET to focus): NCCL then logs which transport, "
                "interface and ring it chose.",
            )
        )
    elif debug == "TRACE":
        flags.append(
            _flag(
                "warn",
                "NCCL_DEBUG",
                "=TRACE logs every collective call: slow and huge logs. Use INFO, or unset it "
                "outside debugging.",
            )
        )
    if env.get("NCCL_DEBUG_SUBSYS") and not debug:
        flags.append(
            _flag(
                "warn",
                "NCCL_DEBUG_SUBSYS",
                "has no effect without NCCL_DEBUG (set NCCL_DEBUG=INFO as well).",
            )
        )
    tdd = env.get("TORCH_DISTRIBUTED_DEBUG", "").upper()
    if tdd == "DETAIL":
        flags.append(
            _flag(
                "warn",
                "TORCH_DISTRIBUTED_DEBUG",
                "=DETAIL checks every collective against the other ranks (an extra "
                "collective each time) and logs DDP internals: a debugging aid for "
                "collective mismatches that slows training. Unset it in production runs.",
            )
        )
    for name in ("NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_DESYNC_DEBUG"):
        if name in env and f"TORCH_{name}" not in env:
            flags.append(
                _flag(
                    "info",
                    name,
                    f"is the old name of TORCH_{name} (torch >= 2.2 reads both, and warns). "
                    f"Rename it.",
                )
            )
    async_eh = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING"))
    if async_eh is not None and async_eh.strip() == "0":
        flags.append(
            _flag(
                "bad",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "=0 turns off NCCL error handling: a failed or timed-out collective is not "
                "acted on, so the other ranks hang instead of the job failing. Unset it "
                "(torch's default tears the process down so torchrun can restart the job).",
            )
        )
    blocking = env.get("TORCH_NCCL_BLOCKING_WAIT", env.get("NCCL_BLOCKING_WAIT"))
    if blocking is not None and blocking.strip() not in ("", "0"):
        flags.append(
            _flag(
                "warn",
                "TORCH_NCCL_BLOCKING_WAIT",
                "=1 makes the host block in every collective's wait() until it finishes (and "
                "raise there on timeout): host and device no longer overlap. Not needed for "
                "timeouts (async error handling already aborts); a debugging aid only.",
            )
        )
    if "CUDA_LAUNCH_BLOCKING" in on:
        flags.append(
            _flag(
                "bad",
                "CUDA_LAUNCH_BLOCKING",
                "=1 makes every CUDA kernel launch synchronous: several times slower. It is "
                "for locating a CUDA error's true line; unset it afterwards.",
            )
        )
    for name, instead in (
        ("PYTHONGC_THRESHOLD", "gc.set_threshold(...) in code, or guard(gc_every_n_steps=...)"),
        ("CUDA_MEMORY_FRACTION", "torch.cuda.set_per_process_memory_fraction(0.9)"),
    ):
        if name in env:
            flags.append(
                _flag(
                    "bad",
                    name,
                    f"is not read by Python or PyTorch (a seed recommends it, but nothing looks "
                    f"at it): it does nothing. Use {instead}.",
                )
            )
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    local_rank = _as_int(env.get("LOCAL_RANK"))
    if cvd is not None:
        visible = [d for d in cvd.split(",") if d.strip()]
        if not visible:
            flags.append(
                _flag(
                    "warn",
                    "CUDA_VISIBLE_DEVICES",
                    "is set but empty: it hides every GPU from this process. Unset it to use "
                    "the GPUs.",
                )
            )
        elif local_rank is not None and local_rank >= len(visible):
            flags.append(
                _flag(
                    "bad",
                    "CUDA_VISIBLE_DEVICES",
                    f"={cvd} shows {len(visible)} device(s) but LOCAL_RANK is {local_rank}: "
                    f"torch.cuda.set_device({local_rank}) fails with 'invalid device "
                    "ordinal'. Seed 002: let torchrun assign the GPUs (no per-process "
                    "CUDA_VISIBLE_DEVICES); to restrict them, set it once for the whole "
                    "torchrun command, covering nproc_per_node devices.",
                )
            )
        elif under_torchrun and len(visible) < local_world:
            flags.append(
                _flag(
                    "warn",
                    "CUDA_VISIBLE_DEVICES",
                    f"={cvd} shows fewer devices ({len(visible)}) than ranks on this node "
                    f"({local_world}): ranks will share a GPU or fail with 'invalid device "
                    "ordinal'.",
                )
            )
    master = env.get("MASTER_ADDR", "")
    if world > local_world and master in ("localhost", "127.0.0.1", "::1"):
        flags.append(
            _flag(
                "bad",
                "MASTER_ADDR",
                f"={master} but the job spans nodes (WORLD_SIZE {world}, {local_world} per "
                "node): the other nodes cannot reach it and hang at init. Use the master "
                "node's routable address.",
            )
        )
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if env.get(name):
            flags += _ifname_flags(name, env[name])
    omp = _as_int(env.get("OMP_NUM_THREADS"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if omp is not None and cpus and omp * local_world > cpus:
        flags.append(
            _flag(
                "warn",
                "OMP_NUM_THREADS",
                f"={omp} x {local_world} rank(s) on this node = {omp * local_world} threads "
                f"for {cpus} usable CPUs: oversubscribed, CPU ops and the data loader slow "
                f"down. Use OMP_NUM_THREADS={max(1, cpus // local_world)}.",
            )
        )
    return flags


def _ifname_flags(name: str, value: str) -> list[dict[str, str]]:
    """NCCL/gloo take a comma list of interface prefixes (``=eth0`` exact, ``^docker``
    excluded); one that matches no interface here makes init hang."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return []
    wanted = [v.strip() for v in value.split(",") if v.strip()]
    if wanted and wanted[0].startswith("^"):
        return []
    exact = bool(wanted) and wanted[0].startswith("=")
    wanted = [w.lstrip("=") for w in wanted]
    match = [n for n in names if any((n == w) if exact else n.startswith(w) for w in wanted)]
    if not match:
        return [
            _flag(
                "bad",
                name,
                f"={value} matches no network interface on this host "
                f"({', '.join(names)}): the rendezvous cannot connect and hangs. Use one "
                "of those (`ip -br addr` shows which carries the cluster's network).",
            )
        ]
    if all(n.startswith(("wl", "wlan")) for n in match):
        return [
            _flag(
                "warn",
                name,
                f"={value} is a wireless interface: every step's gradient all-reduce crosses "
                "it and will dominate the step time (seed 004). Use a wired link.",
            )
        ]
    return []


def _gpu_flags(gpus: dict[str, Any]) -> list[dict[str, str]]:
    flags = []
    for d in gpus.get("devices", []):
        tag = f"GPU {d.get('index')}"
        if (d.get("ecc_uncorrected") or 0) > 0:
            flags.append(
                _flag(
                    "bad",
                    tag,
                    f"{d['ecc_uncorrected']} uncorrected ECC error(s) since the driver loaded: "
                    "suspect the hardware (NaNs that do not reproduce, crashes). Check "
                    "`nvidia-smi -q -d ECC,PAGE_RETIREMENT` and dmesg for Xid errors; drain "
                    "the node.",
                )
            )
        reasons = d.get("throttle_reasons")
        active = [
            t for bit, t in _THROTTLE_BITS.items() if isinstance(reasons, int) and reasons & bit
        ]
        if active:
            flags.append(
                _flag(
                    "warn",
                    tag,
                    f"is throttling ({', '.join(active)}): SM clock {d.get('sm_clock_mhz')} of "
                    f"max {d.get('sm_clock_max_mhz')} MHz. One slow GPU slows every rank "
                    "(seed 002); check cooling and power limits.",
                )
            )
        clock, top, util = d.get("sm_clock_mhz"), d.get("sm_clock_max_mhz"), d.get("util_pct")
        if (
            reasons is None
            and all(isinstance(x, (int, float)) for x in (clock, top, util))
            and util >= 50
            and clock < 0.85 * top
        ):
            # No throttle reasons (an old driver): a busy GPU well below its max clock.
            flags.append(
                _flag(
                    "warn",
                    tag,
                    f"runs at SM {clock} of max {top} MHz while {util}% busy: probably "
                    "throttling (thermal or power). `nvidia-smi -q -d PERFORMANCE` says why.",
                )
            )
        temp = d.get("temp_c")
        if isinstance(temp, (int, float)) and temp >= _HOT_C:
            flags.append(_flag("warn", tag, f"is at {temp} C: expect thermal throttling."))
    for p in gpus.get("processes", []):
        if p["pid"] in _ancestors():
            continue
        flags.append(
            _flag(
                "warn",
                f"pid {p['pid']}",
                f"holds {_mib(p.get('used_mib'))} on GPU {p['gpu']} ({(p['name'] or '?')[:80]}). "
                "If it is left from a previous run (a zombie), it takes memory and can keep "
                f"the rendezvous port: `kill {p['pid']}` (seed 002: 'Address already in use').",
            )
        )
    return flags


def _cpu_flags(cpu: dict[str, Any]) -> list[dict[str, str]]:
    if cpu.get("bf16_native") is False:
        return [
            _flag(
                "info",
                "CPU bf16",
                "this CPU has no native bf16 (no avx512_bf16 / amx_bf16): bf16 math on CPU is "
                "emulated through float32 and can be many times slower (seed 004's CPU run "
                "auto-picked bf16 because a GPU was present). Train CPU runs in float32.",
            )
        ]
    return []


def _as_int(v: str | None) -> int | None:
    try:
        return None if v is None else int(v)
    except ValueError:
        return None


def _mib(v: Any) -> str:
    return "?" if not isinstance(v, (int, float)) else f"{v:,.0f} MiB"


# ---------------------------------------------------------------------------- ranks


def gather(report: dict[str, Any], timeout_s: float = 60.0) -> list[dict[str, Any]] | None:
    """Under torchrun (WORLD_SIZE > 1), every rank's report, in rank order, on every rank;
    None when not distributed. Uses the env rendezvous and a gloo group, destroyed after
    (doctor touches no GPU)."""
    if (_int_env("WORLD_SIZE") or 1) <= 1:
        return None
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group(
            "gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s)
        )
    try:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, report)
        return out
    finally:
        if own:
            dist.destroy_process_group()


def rank_differences(reports: list[dict[str, Any]]) -> list[str]:
    """Lines naming what differs between ranks (versions, env, CPU, GPU models, Python),
    ignoring what legitimately differs (rank ids, pids, hosts, live GPU readings)."""

    def facts(r: dict[str, Any]) -> dict[str, Any]:
        f: dict[str, Any] = {"python": r.get("python")}
        for k, v in (r.get("versions") or {}).items():
            f[f"versions.{k}"] = v
        for k in ("capability", "bf16_native", "usable_cpus", "torch_threads"):
            f[f"cpu.{k}"] = (r.get("cpu") or {}).get(k)
        f["gpus"] = [d.get("name") for d in (r.get("gpus") or {}).get("devices", [])]
        for k, v in (r.get("env_all") or r.get("env") or {}).items():
            if k not in PER_RANK:
                f[f"env.{k}"] = v
        return f

    all_facts = [facts(r) for r in reports]
    keys = sorted(set().union(*all_facts))
    lines = []
    for key in keys:
        values = [f.get(key, "<unset>") for f in all_facts]
        if len({json.dumps(v, default=str) for v in values}) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in zip(reports, values, strict=True):
                groups.setdefault(json.dumps(v, default=str), []).append(r.get("rank") or 0)
            shown = "; ".join(f"rank {_ranks(rs)}: {v}" for v, rs in groups.items())
            lines.append(f"{key} differs: {shown}")
    return lines


def _ranks(rs: list[int]) -> str:
    return ",".join(map(str, rs)) if len(rs) <= 6 else f"{rs[0]}..{rs[-1]} ({len(rs)})"


# ---------------------------------------------------------------------------- render


def render(report: dict[str, Any], reports: list[dict[str, Any]] | None = None) -> str:
    """The one-screen text for a human."""
    v = report.get("versions", {})
    lines = [
        f"guardrails doctor: {report['host']}, {report['time']}"
        + (f", rank {report['rank']}" if report.get("rank") is not None else ""),
        "",
        "versions",
        f"  torch {v.get('torch')}, CUDA {v.get('cuda') or 'none (CPU build)'}, "
        f"cuDNN {v.get('cudnn') or 'none'}, NCCL {v.get('nccl') or 'none'}",
        f"  python {report['python']}",
        f"  backends: gloo {'yes' if v.get('gloo') else 'no'}, "
        f"nccl {'yes' if v.get('nccl_backend') else 'no'}; "
        f"torch.cuda.is_available() {v.get('cuda_available')}, "
        f"{v.get('cuda_devices')} device(s)",
        "",
        "GPUs",
    ]
    gpus = report.get("gpus", {})
    devices = gpus.get("devices", [])
    if not devices:
        why = gpus.get("why") or gpus.get("error") or "the driver lists none"
        lines.append(f"  no GPU found: {why}")
    for d in devices:
        clock = ""
        if d.get("sm_clock_mhz") is not None and d.get("sm_clock_max_mhz"):
            clock = f", SM {d['sm_clock_mhz']}/{d['sm_clock_max_mhz']} MHz"
        ecc = d.get("ecc_uncorrected")
        lines.append(
            f"  [{d.get('index')}] {d.get('name')}: "
            f"{_mib(d.get('memory_used_mib'))} / {_mib(d.get('memory_total_mib'))} used, "
            f"util {_pct(d.get('util_pct'))}, {d.get('temp_c', '?')} C{clock}, "
            f"ECC uncorrected {'n/a' if ecc is None else ecc}"
        )
    if gpus.get("source"):
        lines.append(f"  (read via {gpus['source']})")
    procs = gpus.get("processes", [])
    if devices:
        lines.append(
            f"  processes holding GPU memory: {len(procs)}"
            + ("" if procs else " (no zombies from a previous run)")
        )
        for p in procs:
            lines.append(
                f"    pid {p['pid']} on GPU {p['gpu']}: {_mib(p.get('used_mib'))}  "
                f"{(p.get('name') or '?')[:90]}"
            )
    topo = report.get("topology", {})
    lines += ["", "topology"]
    if topo.get("matrix"):
        lines += [f"  {t}" for t in topo["matrix"].splitlines()]
    else:
        lines.append(f"  unavailable: {topo.get('why') or topo.get('error')}")

    cpu = report.get("cpu", {})
    bf16 = [n for n in ("avx512_bf16", "amx_bf16") if cpu.get(n)]
    lines += [
        "",
        "CPU",
        f"  {cpu.get('model')}: {cpu.get('usable_cpus')} usable of {cpu.get('logical_cpus')} "
        f"logical CPUs, torch threads {cpu.get('torch_threads')}, "
        f"kernels {cpu.get('capability')}",
        "  bf16: "
        + (f"native ({', '.join(bf16)})" if bf16 else "not native (emulated; use float32)"),
        "",
        "rendezvous port",
    ]
    for p in report.get("ports") or []:
        if not isinstance(p, dict):
            continue
        label = f"  {p['port']}" + (" (MASTER_PORT)" if p.get("master_port") else " (default)")
        if p["status"] != "in use":
            lines.append(f"{label}: {p['status']}")
            continue
        holders = p.get("holders")
        if not holders:
            lines.append(
                f"{label}: in use by a process not visible here (another user's?): "
                f"`sudo ss -ltnp 'sport = :{p['port']}'` names it; or launch with "
                f"--master-port {p['port'] + 1}"
            )
        for h in holders or []:
            what = (
                "this job's rendezvous store (expected)"
                if h["ours"]
                else f"stop it (`kill {h['pid']}`) or pick another port (--master-port)"
            )
            lines.append(f"{label}: in use by pid {h['pid']} ({(h['cmd'] or '?')[:70]}): {what}")

    env = report.get("env", {})
    lines += ["", "environment (NCCL_*, GLOO_*, TORCH_*, MASTER_*, CUDA_VISIBLE_DEVICES, ...)"]
    lines += [f"  {k}={val}" for k, val in env.items()] or ["  none set"]

    flags = report.get("flags", [])
    lines += ["", f"flags: {len(flags)}" if flags else "flags: none"]
    mark = {"bad": "BAD ", "warn": "WARN", "info": "note"}
    for f in flags:
        lines.append(f"  {mark.get(f['level'], f['level'])} {f['name']}: {f['message']}")

    if reports is not None:
        lines += ["", f"ranks: {len(reports)} reported"]
        hosts = sorted({r.get("host", "?") for r in reports})
        lines.append(f"  hosts: {', '.join(hosts)}")
        diffs = rank_differences(reports)
        lines.append("differences between ranks: " + ("none" if not diffs else str(len(diffs))))
        lines += [f"  {d}" for d in diffs]
        for r in reports:
            if r is report:
                continue
            for f in r.get("flags", []):
                if f not in report.get("flags", []):
                    lines.append(
                        f"  rank {r.get('rank')} only: {mark.get(f['level'])} "
                        f"{f['name']}: {f['message']}"
                    )
    return "\n".join(lines)


def _pct(v: Any) -> str:
    return "?" if v is None else f"{v}%"


# ---------------------------------------------------------------------------- CLI


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="environment report: versions, GPUs, env flags, port, zombies",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (per-rank list)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    report = collect()
    # Every relevant variable for the rank comparison, not just the ones shown.
    report["env_all"] = {
        k: _redact(k, v) for k, v in os.environ.items() if not k.startswith(("LC_", "_"))
    }
    reports = None
    try:
        reports = gather(report)
    except Exception as exc:
        report["flags"].append(
            _flag(
                "bad",
                "process group",
                f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} but the env:// rendezvous failed "
                f"({type(exc).__name__}: {exc}). Check MASTER_ADDR/MASTER_PORT and the "
                "network; this report is this rank's only.",
            )
        )
    if reports is not None and (report.get("rank") or 0) != 0:
        return 0  # rank 0 prints for everyone
    if args.json:
        strip = [{k: v for k, v in r.items() if k != "env_all"} for r in (reports or [report])]
        if reports is None:
            print(json.dumps(strip[0], indent=2, default=str))
        else:
            print(
                json.dumps(
                    {"ranks": strip, "differences": rank_differences(reports)},
                    indent=2,
                    default=str,
                )
            )
    else:
        print(render(report, reports))
    return 0
