"""What following the GPU's updates costs the host per step (``engine/boundary.py``'s
``UpdateMarks``: two CUDA event records around each ``optimizer.step()`` and the small
record of what the host held before it), on a real guard on CUDA.

    python benchmarks/update_marks.py [--n 20000]

A guard over GPT-2 small (one GPU, fused AdamW, a LambdaLR scheduler) follows the
device as a multi-rank guard does (in one process the failure save never runs from a
thread, so it asks for no marks) and trains with them under
``torch.cuda.set_sync_debug_mode("error")`` (no sync); then the engine's two calls of a
step (``began`` before the update, ``ended`` after it) are timed ``--n`` times, against
the loop's own step timed on the device with CUDA events, in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20_000)
    a = p.parse_args()
    from train_gpt import GPT

    import guardrails

    torch.manual_seed(0)
    model = GPT(50304, 1024, 12, 12, 768).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    data = [(torch.randint(0, 50304, (8, 1024), device="cuda"),) * 2 for _ in range(4)]

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as run_dir:
        with guardrails.guard(
            model, opt, data * 10, scheduler=sched, run_dir=run_dir, progress=False
        ) as g:
            assert g.boundary_capture.updates is None, "one process asks for no marks"
            g.boundary_capture.follow_device()
            marks = g.boundary_capture.updates
            for i, (x, y) in enumerate(g):
                if i == 5:
                    torch.cuda.set_sync_debug_mode("error")
                step(x, y)
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            out["device_step_when_idle"], out["host_step"] = marks.device_step(), g.step
            n = a.n

            def both() -> None:
                marks.began(g)
                marks.ended(g.step)

            both()
            per = min(timeit.repeat(both, number=n, repeat=5)) / n
            out["marks_host_us_per_step"] = round(per * 1e6, 2)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            x, y = data[0]
            start.record()
            for _ in range(10):
                step(x, y)
            end.record()
            end.synchronize()
            out["step_device_ms"] = round(start.elapsed_time(end) / 10, 2)
            out["marks_share_of_step"] = round(per * 1e3 / out["step_device_ms"], 6)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
