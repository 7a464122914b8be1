"""What the rewind guard's snapshot costs: bytes, host memory, time, and its hooks on
the steps without one.

    python benchmarks/snapshot_cost.py --params-m 25 --device cpu
    python benchmarks/snapshot_cost.py --params-m 124 --device cuda

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
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import guardrails
from guardrails.guards.rewind.rewind import Rewind


def _model(params_m: float, width: int = 1024) -> nn.Module:
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-m", type=float, default=25.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
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
