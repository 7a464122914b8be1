"""What the re-run checks (issue 19) cost, against the save they sit beside, in one run.

    python benchmarks/rerun_cost.py [--width 1024] [--layers 12] [--repeats 20]

None of it is per step: ``run_record`` (the config and the optimizers' settings, read
once when the guard starts), ``saved_run`` + the comparisons (once at a resume), and
``mark_finished`` (once at the close of a run that ended normally: the manifest
rewritten, fsynced and renamed). The baseline is a ``save_checkpoint`` of the same
model and optimizer in the same process, to the same disk (the temp directory unless
``--dir``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from guardrails import save_checkpoint
from guardrails.checkpoint import commit, restore


def timed(fn, repeats: int) -> float:
    """The median seconds of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--config-keys", type=int, default=100)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rerun_cost-", dir=a.dir))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(a.layers)])
        params = list(model.parameters())
        opt = torch.optim.AdamW(
            [{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}], lr=1e-3
        )
        model(torch.randn(2, a.width)).sum().backward()
        opt.step()  # the optimizer's state exists, as at a real save
        config = {f"key{i}": i * 0.1 for i in range(a.config_keys)}
        step = iter(range(1, 1 << 30))
        save_s = timed(
            lambda: save_checkpoint(root, next(step), model=model, optimizer=opt, keep_last=1),
            max(3, a.repeats // 4),
        )
        ckpt = format.list_checkpoints(root)[-1][1]
        record_s = timed(lambda: commit.run_record(config, {"optimizer": opt}), a.repeats)
        read_s = timed(lambda: restore.saved_run(ckpt), a.repeats)
        mark_s = timed(lambda: commit.mark_finished(ckpt, time.time()), a.repeats)
        mb = sum(f.stat().st_size for f in ckpt.iterdir()) / 1e6
        print(f"torch {torch.__version__}, {mb:.0f} MB checkpoint on {root.parent}")
        print(f"save_checkpoint (baseline)       {save_s * 1e3:9.2f} ms  (once per save)")
        keys = f"run_record ({a.config_keys} keys, 2 groups)"
        print(f"{keys:33}{record_s * 1e3:9.3f} ms  (once, at start)")
        print(f"saved_run (read the manifest)    {read_s * 1e3:9.3f} ms  (once, at a resume)")
        print(f"mark_finished                    {mark_s * 1e3:9.2f} ms  (once, at a normal end)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
