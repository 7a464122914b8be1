"""Readings of this host for diagnosis: versions, GPUs, topology, CPU, ports, processes.

Each function reads one thing and returns plain JSON-able data; none judges it (that is
:mod:`guardrails.cli.doctor` for the ``doctor`` report and :mod:`guardrails.cli.env_rules` for
the environment). ``doctor`` shows them; other modules reuse single readings where an
error needs them: :mod:`guardrails.distributed.launch` asks whether ``MASTER_PORT`` is taken and
by whom (:func:`port_status`), :mod:`guardrails.guards.explain` names the holder of the port
in an "Address already in use" error (:func:`port_holders`), and the preflight compares
the ranks' CPUs (:func:`cpu_info`: bf16 support differs between node types).

Every probe tolerates a missing tool or library: GPUs come from NVML (the optional
``nvml`` extra: ``nvidia-ml-py``), else from parsing ``nvidia-smi --query-gpu``, else as
an empty list with the reason; an external tool is given a timeout and never hangs the
caller. Nothing here creates a CUDA context (``torch.cuda.device_count()`` asks NVML), so
reading holds no GPU memory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import re
import shutil
import socket
import subprocess
import warnings
from pathlib import Path
from typing import Any

DEFAULT_PORT = 29500  # torchrun's and init_process_group's default MASTER_PORT
_TOOL_TIMEOUT_S = 15.0  # nvidia-smi can take seconds on a busy 8-GPU node; never hang on it

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
_CSV = "--format=csv,noheader,nounits"
NVML_MISSING = 'NVML bindings not installed (pip install "torch-guardrails[nvml]")'


def int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


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


def torch_versions() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # None: a CPU build (or a ROCm one: "hip")
        "hip": getattr(torch.version, "hip", None),
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
        # CUDA context: doctor holds no GPU memory. A CUDA build on a machine without a
        # driver warns ("CUDA initialization: Found no NVIDIA driver..."): that is the
        # reason the report gives, not a stray warning above it.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["cuda_available"] = torch.cuda.is_available()
            out["cuda_devices"] = torch.cuda.device_count()
        if caught:
            out["cuda_warning"] = str(caught[0].message).strip().splitlines()[0]
    except Exception as exc:
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return out


def gpu_info() -> dict[str, Any]:
    """GPUs and the processes holding their memory: NVML, else nvidia-smi."""
    why: list[str] = []
    try:
        return _gpus_nvml()
    except ImportError:
        why.append(NVML_MISSING)
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
                        "name": cmdline(p.pid) or "?",
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
                        "name": cmdline(pid) or cells[2],
                        "used_mib": _num(cells[3]),
                    }
                )
    return {"source": "nvidia-smi", "devices": devices, "processes": processes}


def gpu_topology() -> dict[str, Any]:
    code, out = _run(["nvidia-smi", "topo", "-m"])
    # nvidia-smi underlines the header with ANSI escapes even into a pipe (seen on an
    # H200 host): strip them, they garble logs and JSON.
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)
    if code == 0:
        return {"matrix": out}
    return {"matrix": None, "why": out or f"nvidia-smi topo -m exited {code}"}


def cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's
    share), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_info() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "model": platform.processor() or platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
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


def rendezvous_ports() -> list[dict[str, Any]]:
    ports = [DEFAULT_PORT]
    master = int_env("MASTER_PORT")
    if master is not None and master != DEFAULT_PORT:
        ports.append(master)
    return [port_status(p) for p in ports]


def port_status(port: int) -> dict[str, Any]:
    """Try to bind the port the way TCPStore does (SO_REUSEADDR); name the holder."""
    out: dict[str, Any] = {"port": port, "master_port": int_env("MASTER_PORT") == port}
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
    out["holders"] = port_holders(port)
    return out


def port_holders(port: int) -> list[dict[str, Any]] | None:
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
    ours = ancestors() if "TORCHELASTIC_RUN_ID" in os.environ else set()
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
                holders.append({"pid": pid, "cmd": cmdline(pid), "ours": pid in ours})
                break
    return holders or None


def stat_fields(path: str) -> list[str] | None:
    """The fields of a Linux ``/proc/<pid>/stat`` (or ``/proc/<pid>/task/<tid>/stat``)
    after the command name, which may itself hold spaces and ")": field 3 of stat(5)
    (the state) is item 0. ``None`` where it cannot be read (not Linux, gone)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def ancestors() -> set[int]:
    """This process and its parents (a torchrun agent holding MASTER_PORT is ours)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        fields = stat_fields(f"/proc/{pid}/stat")
        try:
            pid = int(fields[1])  # type: ignore[index]
        except (TypeError, ValueError, IndexError):
            break
    return pids
