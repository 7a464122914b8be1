"""``python -m guardrails doctor``: the diagnostic script people paste by hand, as one command.

When a distributed job hangs or crawls, the first questions are always the same: which
torch, CUDA and NCCL; which GPUs, how hot, throttled or not, with ECC errors or not;
how they are connected (``nvidia-smi topo -m``); which processes still hold GPU memory
(a zombie from the last run); which ``NCCL_*`` / ``TORCH_*`` variables are set (several
that people set while debugging make things worse when left on); whether the CPU has
native bf16 (without it a bf16 CPU run is emulated and many times slower); whether the
rendezvous port is free. And across nodes: do the ranks agree on all of that (a
two-node hang can come down to ranks that see different data directories). Doctor
answers them in one screen:

* versions: guardrails, torch (a CPU-only or a CUDA build, and whether it sees a GPU),
  CUDA, cuDNN, NCCL, Python; backends available;
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

This module is the command: it assembles the report, judges the hardware readings
(ECC, throttling, temperature, leftover processes, bf16), compares ranks and renders
the text or JSON. The readings themselves are :mod:`guardrails.util.probes`; the table of
environment settings and what each does wrong is :mod:`guardrails.cli.env_rules`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import socket
import sys
from typing import Any

from guardrails._version import __version__
from guardrails.cli.env_rules import env_flags
from guardrails.cli.env_rules import flag as _flag
from guardrails.util import probes
from guardrails.util.probes import int_env as _int_env

logger = logging.getLogger("guardrails.doctor")

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
        ("versions", probes.torch_versions),
        ("gpus", probes.gpu_info),
        ("topology", probes.gpu_topology),
        ("cpu", probes.cpu_info),
        ("ports", probes.rendezvous_ports),
    ):
        try:
            report[key] = probe()
        except Exception as exc:  # a probe bug must not hide the rest of the report
            report[key] = {"error": f"{type(exc).__name__}: {exc}"}
    env = {k: v for k, v in os.environ.items() if _relevant(k)}
    report["env"] = {k: _redact(k, v) for k, v in sorted(env.items())}
    versions = report.get("versions") or {}
    if isinstance(versions, dict) and "torch" in versions:
        versions["guardrails"] = __version__
        cuda_build = bool(versions.get("cuda") or versions.get("hip"))
        gpu_visible = bool(versions.get("cuda_available"))
    else:  # the torch probe failed: judge everything, as on a GPU machine
        cuda_build = gpu_visible = True
    report["flags"] = env_flags(dict(os.environ), cuda_build=cuda_build, gpu_visible=gpu_visible)
    report["flags"] += _build_flags(versions, report.get("gpus", {}))
    report["flags"] += _gpu_flags(report.get("gpus", {}))
    report["flags"] += _cpu_flags(report.get("cpu", {}))
    return report


def _relevant(name: str) -> bool:
    return name.startswith(ENV_PREFIXES) or name in ENV_NAMES


def _redact(name: str, value: str) -> str:
    return "<redacted>" if _SECRET.search(name) else value


# ---------------------------------------------------------------------------- flags


def _build_flags(versions: dict[str, Any], gpus: dict[str, Any]) -> list[dict[str, str]]:
    """GPUs on the host that this torch cannot use."""
    n = len(gpus.get("devices") or [])
    if not n or "torch" not in versions:
        return []
    if not (versions.get("cuda") or versions.get("hip")):
        return [
            _flag(
                "bad",
                "torch build",
                f"this host has {n} GPU(s) but torch {versions['torch']} is a CPU-only build: "
                "training runs on the CPU. Install a CUDA build (the command for your CUDA "
                "version is on pytorch.org, Get Started).",
            )
        ]
    if not versions.get("cuda_available"):
        why = versions.get("cuda_warning") or versions.get("cuda_error") or "no reason given"
        return [
            _flag(
                "bad",
                "torch build",
                f"the driver lists {n} GPU(s) but torch sees none ({why}). Check "
                "CUDA_VISIBLE_DEVICES and that the driver supports torch's CUDA "
                f"{versions.get('cuda')} (`nvidia-smi` shows the highest CUDA it supports).",
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
                    "(each collective waits for the slowest); check cooling and power limits.",
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
        if p["pid"] in probes.ancestors():
            continue
        flags.append(
            _flag(
                "warn",
                f"pid {p['pid']}",
                f"holds {_mib(p.get('used_mib'))} on GPU {p['gpu']} ({(p['name'] or '?')[:80]}). "
                "If it is left from a previous run (a zombie), it takes memory and can keep "
                f"the rendezvous port (the next launch fails with 'Address already in use'): "
                f"`kill {p['pid']}`.",
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
                "emulated through float32 and can be many times slower (a CPU run ends up in "
                "bf16 when code picks the dtype because a GPU is present). Train CPU runs in "
                "float32.",
            )
        ]
    return []


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


#: How each level of flag is marked in the text.
_MARK = {"bad": "BAD ", "warn": "WARN", "info": "note"}


def render(report: dict[str, Any], reports: list[dict[str, Any]] | None = None) -> str:
    """The one-screen text for a human: versions, GPUs, topology, CPU, the rendezvous
    port, the environment, the flags and, under torchrun, how the ranks differ."""
    lines = [
        f"guardrails doctor: {report['host']}, {report['time']}"
        + (f", rank {report['rank']}" if report.get("rank") is not None else ""),
        *_versions_lines(report),
        *_gpu_lines(report),
        *_cpu_lines(report),
        *_port_lines(report),
    ]
    env = report.get("env", {})
    lines += ["", "environment (NCCL_*, GLOO_*, TORCH_*, MASTER_*, CUDA_VISIBLE_DEVICES, ...)"]
    lines += [f"  {k}={val}" for k, val in env.items()] or ["  none set"]

    flags = report.get("flags", [])
    lines += ["", f"flags: {len(flags)}" if flags else "flags: none"]
    for f in flags:
        lines.append(f"  {_MARK.get(f['level'], f['level'])} {f['name']}: {f['message']}")
    if reports is not None:
        lines += _ranks_lines(report, reports)
    return "\n".join(lines)


def _versions_lines(report: dict[str, Any]) -> list[str]:
    v = report.get("versions", {})
    return [
        "",
        "versions",
        f"  guardrails {v.get('guardrails', __version__)}",
        f"  torch {v.get('torch')}, "
        + (f"ROCm {v['hip']}" if v.get("hip") else f"CUDA {v.get('cuda') or 'none (CPU build)'}")
        + ", "
        f"cuDNN {v.get('cudnn') or 'none'}, NCCL {v.get('nccl') or 'none'}",
        f"  python {report['python']}",
        f"  backends: gloo {'yes' if v.get('gloo') else 'no'}, "
        f"nccl {'yes' if v.get('nccl_backend') else 'no'}; "
        f"torch.cuda.is_available() {v.get('cuda_available')}, "
        f"{v.get('cuda_devices')} device(s)",
    ]


def _gpu_lines(report: dict[str, Any]) -> list[str]:
    """The GPUs torch sees (or why none), each device's state, the processes holding
    GPU memory, the topology."""
    v = report.get("versions", {})
    cuda_build = bool(v.get("cuda") or v.get("hip"))
    lines = ["", "GPUs"]
    gpus = report.get("gpus", {})
    devices = gpus.get("devices", [])
    if "torch" in v and not cuda_build:
        lines.append("  torch is a CPU-only build: it uses no GPU")
    elif "torch" in v and not v.get("cuda_available"):
        why = v.get("cuda_warning") or v.get("cuda_error")
        lines.append(
            f"  no GPU visible to torch (a CUDA {v.get('cuda') or v.get('hip')} build; "
            "torch.cuda.is_available() is False): this process would train on the CPU"
            + (f"; torch says: {why}" if why else "")
        )
    if not devices:
        why = gpus.get("why") or gpus.get("error") or "the driver lists none"
        if "torch" in v and not cuda_build:  # installing NVML bindings would not help
            why = "; ".join(p for p in why.split("; ") if p != probes.NVML_MISSING) or why
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
    return lines


def _cpu_lines(report: dict[str, Any]) -> list[str]:
    cpu = report.get("cpu", {})
    bf16 = [n for n in ("avx512_bf16", "amx_bf16") if cpu.get(n)]
    return [
        "",
        "CPU",
        f"  {cpu.get('model')}: {cpu.get('usable_cpus')} usable of {cpu.get('logical_cpus')} "
        f"logical CPUs, torch threads {cpu.get('torch_threads')}, "
        f"kernels {cpu.get('capability')}",
        "  bf16: "
        + (f"native ({', '.join(bf16)})" if bf16 else "not native (emulated; use float32)"),
    ]


def _port_lines(report: dict[str, Any]) -> list[str]:
    """Each rendezvous port: free, or who holds it and what to do."""
    lines = ["", "rendezvous port"]
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
    return lines


def _ranks_lines(report: dict[str, Any], reports: list[dict[str, Any]]) -> list[str]:
    """Under torchrun: the ranks that reported, their hosts, how they differ and the
    flags only some ranks raised."""
    lines = ["", f"ranks: {len(reports)} reported"]
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
                    f"  rank {r.get('rank')} only: {_MARK.get(f['level'])} "
                    f"{f['name']}: {f['message']}"
                )
    return lines


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
