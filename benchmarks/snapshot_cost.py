"""What the rewind guard's snapshot costs: bytes, host memory, time, and its hooks on
the steps without one.

    python benchmarks/snapshot_cost.py --params-m 25 --device cpu
    python benchmarks/snapshot_cost.py --params-m 124 --device cuda
    python benchmarks/snapshot_cost.py --gpt --every 10     # CUDA: a real step, see below

An MLP of about ``--params-m`` million float32 parameters under AdamW (its state made by
one step), guarded with ``rewind={"snapshot_every_steps": 10**9}`` (no snapshot but the
first one, taken by the script). Reported: the bytes a snapshot holds (weights and the
optimizer's moments: 3x the parameters' bytes with AdamW), the host memory the two slots
hold once both are taken, and the median of ``--repeats`` snapshots' times:

* ``take``: the host's time in ``Snapshot.take`` (on CUDA: it enqueues the copies to
  pinned memory and returns; run under ``torch.cuda.set_sync_debug_mode("error")``, so a
  host sync in it would raise);
* ``copy done`` (CUDA): until the device has finished those copies (``synchronize``);
* ``restore``: putting it back (``load_state_dict`` of the model and the optimizer);
* ``hooks, other steps``: the rewind guard's ``before_step`` + ``after_step`` +
  ``on_boundary`` on a step that takes no snapshot (what every step pays).

``--gpt`` (CUDA): what a snapshot costs a real training step. A 0.835B GPT
(``examples/train_gpt.py``'s, 27 x 1536, fused AdamW, bf16 autocast, 4 x 1024 tokens)
trains ``--steps`` steps twice in one process: guarded without rewind (the plain step),
then with ``rewind={"snapshot_every_steps": --every}``. Each step's device time is the
gap between CUDA events recorded at the top of consecutive loop bodies (the step's
kernels plus the boundary's work on the training stream; no sync per step), read at
the end. The slots' pinned memory is allocated ahead in a thread: the run waits for it
after step 2 (its time reported) so the snapshots measured are the steady state. One
snapshot's steps run under the profiler: device-to-host and device-to-device copy time
and how much of the device-to-host copy overlapped kernels. Host memory: the process's
resident set after each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import guardrails
from guardrails.guards.rewind.rewind import Rewind


def _model(params_m: float, width: int = 1024) -> nn.Module:
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _overlap_us(prof) -> dict[str, float]:
    """Device-to-host / device-to-device copy time in a profile, and the share of the
    device-to-host copies that ran while a kernel did."""
    kernels, d2h, d2d = [], [], []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        span = (e.time_range.start, e.time_range.end)
        if "Memcpy DtoH" in e.name:
            d2h.append(span)
        elif "Memcpy DtoD" in e.name:
            d2d.append(span)
        elif "Memcpy" not in e.name and "Memset" not in e.name:
            kernels.append(span)
    kernels.sort()
    merged: list[list[float]] = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    over = sum(max(0.0, min(b, kb) - max(a, ka)) for a, b in d2h for ka, kb in merged)
    total = sum(b - a for a, b in d2h)
    return {
        "d2h_us": round(total),
        "d2h_under_kernels_us": round(over),
        "d2d_us": round(sum(b - a for a, b in d2d)),
        "kernels_us": round(sum(b - a for a, b in merged)),
    }


def _gpt_run(a: argparse.Namespace, every: int | None) -> dict:
    """``--steps`` steps of the GPT, guarded, rewind every ``every`` steps (None: off):
    each step's device ms (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from train_gpt import GPT

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = GPT(50304, 1024, a.layers, a.width // 128, a.width).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = [(torch.randint(0, 50304, (a.batch, 1024), device=dev),) * 2 for _ in range(4)]
    marks: list[torch.cuda.Event] = []
    out: dict = {"every": every}
    rewind = {"snapshot_every_steps": every} if every else False
    profile_at = every * (a.steps // every - 1) if every else -1
    prof = None
    with tempfile.TemporaryDirectory() as tmp:
        with guardrails.guard(
            model, opt, data * 10_000, run_dir=tmp, progress=False, rewind=rewind
        ) as g:
            for i, (x, y) in enumerate(g, 1):
                mark = torch.cuda.Event(enable_timing=True)
                mark.record()
                marks.append(mark)
                if i == profile_at:  # this step, its boundary's snapshot, the next two
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    prof.__enter__()
                if prof is not None and i == profile_at + 3:
                    torch.cuda.synchronize()
                    prof.__exit__(None, None, None)
                    out["profile"] = _overlap_us(prof)
                    prof = None
                if i > a.steps:
                    break
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i == 2 and every:  # the slots' memory, pinned ahead in a thread
                    t = time.perf_counter()
                    for slot in next(c for c in g.components if isinstance(c, Rewind))._slots:
                        slot.staging.wait()
                    out["pinning_wait_s"] = round(time.perf_counter() - t, 2)
            torch.cuda.synchronize()
            if every:
                slots = next(c for c in g.components if isinstance(c, Rewind))._slots
                out["snapshot_gb"] = round(slots[0].nbytes / 1e9, 2)
                out["pinned_gb"] = round(sum(s.staging.nbytes for s in slots) / 1e9, 2)
                out["through_device"] = [getattr(s, "through_device", None) for s in slots]
            out["rss_gb"] = round(_rss_gb(), 2)
    ms = {i + 1: marks[i].elapsed_time(marks[i + 1]) for i in range(len(marks) - 1)}
    profiled = range(profile_at, profile_at + 4)  # the profiler's own cost (its exit too)
    out["step_ms"] = {i: round(v, 2) for i, v in ms.items() if i > a.warmup and i not in profiled}
    del model, opt, data, g
    torch.cuda.empty_cache()
    return out


def gpt_main(a: argparse.Namespace) -> None:
    print(
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, guardrails "
        f"{Path(guardrails.__file__).resolve().parent}",
        flush=True,
    )
    plain = _gpt_run(a, None)
    snap = _gpt_run(a, a.every)
    med = statistics.median(plain["step_ms"].values())
    steps = snap["step_ms"]
    at = {i: v for i, v in steps.items() if i % a.every == 0}
    others = [v for i, v in steps.items() if i % a.every]
    after = {i: [round(steps[k] - med, 1) for k in range(i + 1, i + 4) if k in steps] for i in at}
    extra = sum(steps.values()) - med * len(steps)
    per_snapshot = extra / max(1, len(at))
    print(f"  plain step (device)       {med:8.2f} ms median of {len(plain['step_ms'])}")
    print(f"  steps without a snapshot  {statistics.median(others):8.2f} ms median")
    print(f"  step + snapshot boundary  {[round(v, 1) for v in at.values()]} ms")
    print(f"  the 3 steps after (ms over the plain median) {after}")
    print(
        f"  extra device time a snapshot {per_snapshot:8.1f} ms "
        f"({per_snapshot / (a.every * med):.2%} of {a.every} plain steps)"
    )
    k1 = per_snapshot / (0.01 * med)
    print(f"  every K steps under 1%: K >= {k1:.0f}")
    print(
        f"  host memory: plain {plain['rss_gb']} GB, with snapshots {snap['rss_gb']} GB "
        f"(2 slots pinned {snap.get('pinned_gb')} GB, a snapshot {snap.get('snapshot_gb')} GB)"
    )
    print(
        f"  pinning ahead waited {snap.get('pinning_wait_s')} s; through the device "
        f"{snap.get('through_device')}; profile of one snapshot {snap.get('profile')}"
    )
    print("RESULT " + json.dumps({"plain": plain, "snapshots": snap}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-m", type=float, default=25.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--gpt", action="store_true", help="a real step (CUDA; see above)")
    p.add_argument("--every", type=int, default=10, help="--gpt: snapshot_every_steps")
    p.add_argument("--steps", type=int, default=70, help="--gpt: steps per run")
    p.add_argument("--warmup", type=int, default=12, help="--gpt: steps not measured")
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args()
    if a.gpt:
        gpt_main(a)
        return
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = _model(a.params_m).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x = torch.randn(8, 1024, device=dev)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        data = [x] * 4
        with guardrails.guard(
            model,
            opt,
            data,
            run_dir=tmp,
            progress=False,
            rewind={"snapshot_every_steps": 10**9},
            checkpoint=False,
        ) as g:
            for batch in g:
                model(batch).square().mean().backward()
                opt.step()
                opt.zero_grad()
            rw = next(c for c in g.components if isinstance(c, Rewind))
            slots = rw._slots
            takes, dones, restores = [], [], []
            for i in range(a.repeats + 1):
                slot = slots[i % 2]
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                t0 = time.perf_counter()
                slot.take(g, (0, 0))
                t1 = time.perf_counter()
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                slot.restore(g)
                if cuda:
                    torch.cuda.synchronize()
                t3 = time.perf_counter()
                if i >= 2:  # both slots' memory allocated by then
                    takes.append(t1 - t0)
                    dones.append(t2 - t0)
                    restores.append(t3 - t2)
            # The hooks on a step without a snapshot (step 4, every 10**9).
            n = 20000
            t0 = time.perf_counter()
            for _ in range(n):
                rw.before_step(g)
                rw.after_step(g)
                rw.on_boundary(g)
            hooks_us = (time.perf_counter() - t0) / n * 1e6
            held = sum(s.staging.nbytes for s in slots) + sum(
                t.numel() * t.element_size()
                for s in slots
                for t in s._copies
                if not t.is_pinned() and t.device.type == "cpu" and s.staging.pinned
            )
            snap = slots[0].nbytes
    med = statistics.median
    print(
        f"device {dev}, torch {torch.__version__}, {n_params / 1e6:.1f}M float32 parameters, "
        f"AdamW{' (fused)' if cuda else ''}"
    )
    ratio = snap / (4 * n_params)
    print(f"  a snapshot holds      {snap / 2**20:9.1f} MiB ({ratio:.2f}x the weights)")
    print(f"  host memory, 2 slots  {held / 2**20:9.1f} MiB")
    print(f"  take (host time)      {med(takes) * 1e3:9.2f} ms median of {len(takes)}")
    if cuda:
        print(f"  copy done (device)    {med(dones) * 1e3:9.2f} ms median")
    print(f"  restore               {med(restores) * 1e3:9.2f} ms median")
    print(f"  hooks, other steps    {hooks_us:9.2f} us a step")


if __name__ == "__main__":
    main()
