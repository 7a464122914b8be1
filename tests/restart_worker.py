"""A 2-rank gloo DDP loop for tests/distributed/test_restart.py, run by torchrun (or by
the test as two ranks): ``FAULT`` on rank 1 at step ``FAULT_AT`` of the first attempt
(``hang``: a sleep; ``kill``: SIGKILL), or on rank 0 at that step of *every* attempt
(``desync``: a barrier rank 1 never calls). ``RECORD=0`` runs the loop without
``@guardrails.record`` (the process group made by torch's own rendezvous);
``STEP_SLEEP_S`` pads each step. Prints
``attempt K: start at step N`` and ``attempt K: done at step N`` on rank 0.
"""

from __future__ import annotations

import os
import signal
import time

# Each attempt's start, for the test's clock: before torch's import, which a rank that
# refuses a restart first may not let the other finish (torchrun SIGTERMs it).
if int(os.environ.get("RANK", "0")) == 0:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"launched attempt {restart} at {time.time():.3f}", flush=True)

import torch
import torch.distributed as dist

import guardrails

FAULT = os.environ.get("FAULT", "")
AT = int(os.environ.get("FAULT_AT", "20"))
STEPS = int(os.environ.get("STEPS", "40"))
STEP_SLEEP_S = float(os.environ.get("STEP_SLEEP_S", "0.005"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def train() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # GuardedDDP: its gradient buckets are in the audited sequence, so a desync is named.
    model = guardrails.GuardedDDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))] * (2 * STEPS)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler)
    run_dir = os.environ["RUN_DIR"]
    with guardrails.guard(model, opt, loader, run_dir=run_dir, watchdog={"hang_timeout_s": 5}) as g:
        if rank == 0:
            print(f"attempt {ATTEMPT}: start at step {g.step}", flush=True)
        for x, y in g:
            if ATTEMPT == 0 and g.step == AT and rank == 1:
                if FAULT == "hang":
                    time.sleep(1000)
                if FAULT == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
            if FAULT == "desync" and g.step == AT and rank == 0:
                dist.barrier()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(STEP_SLEEP_S)
    if rank == 0:
        print(f"attempt {ATTEMPT}: done at step {g.step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if os.environ.get("RECORD") == "0":
        train()
    else:
        guardrails.record(train)()
