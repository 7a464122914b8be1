"""The issue-50 scenario: 2 gloo ranks, DDP, 300 steps a rank, every default but a 10 s
hang timeout, under `torchrun --max-restarts 1`; on attempt 0 rank 1 sleeps (FAULT=hang) or is
SIGKILLed (FAULT=kill) at step FAULT_AT (150). Run from an empty directory:

    FAULT=hang torchrun --nproc-per-node 2 --max-restarts 1 benchmarks/recovery/issue_scenario.py
"""

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import guardrails

FAULT = os.environ.get("FAULT", "")
AT = int(os.environ.get("FAULT_AT", "150"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@guardrails.record
def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g_ = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 32, generator=g_), torch.randn(16, 1, generator=g_)) for _ in range(600)
    ]
    loader = torch.utils.data.DataLoader(
        data, batch_size=None, sampler=torch.utils.data.DistributedSampler(data, shuffle=False)
    )
    t0 = time.time()
    with guardrails.guard(
        model,
        opt,
        loader,
        run_dir=os.environ.get("RUN_DIR", "run"),
        watchdog={"hang_timeout_s": 10},
    ) as g:
        if rank == 0:
            print(f"attempt {attempt}: start at step {g.step}", flush=True)
        for x, y in g:
            if attempt == 0 and g.step == AT and rank == 1:
                if FAULT == "hang":
                    time.sleep(1000)
                if FAULT == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.01)
    if rank == 0:
        print(f"attempt {attempt}: done at step {g.step} in {time.time() - t0:.1f}s", flush=True)


main()
