"""Which state a failure save writes when the GPU is a step behind its host
(``checkpointer/savepoint.py``): the host's record of the step before its last update
(``engine/boundary.Before``) and what the save takes from it.

The device side (the CUDA events that tell which step the GPU holds) runs on a GPU only
(``tests/loops/test_gpu.py``: 2 DDP ranks over NCCL, bitwise against a periodic save).
Here a real guard on the CPU takes the same record at the same place (``began``'s:
after the step's forward and backward, before its ``optimizer.step()``) and the save is
chosen from it after the update, as the watchdog's thread does when the GPU holds the
step before.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import read_events

import guardrails
from guardrails.engine.boundary import Before
from guardrails.guards.checkpointer import savepoint


def _run(tmp_path, opt_factory):
    """4 steps of a small model with dropout and a scheduler; the record taken before
    step 4's update; the point chosen from it past step 4's boundary, as the thread
    would while the GPU still holds step 3."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = opt_factory(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    batches = [(torch.randn(2, 4) + i,) for i in range(6)]
    got = {}
    with guardrails.guard(
        model, opt, batches, scheduler=sched, run_dir=tmp_path, progress=False
    ) as g:
        for (x,) in g:
            if g.step == 4:  # past step 4's boundary, as a host a step ahead of its GPU
                got["point"] = savepoint._behind(g, got["before"], marks=None)
                got["now_trained_at"] = g.boundary_capture.trained_at
                break
            model(x).sum().backward()
            if g.step == 3:
                got["rng"] = g.boundary_capture.rng_at_boundary()[0]
                got["trained_at"] = g.boundary_capture.trained_at
                got["lr"] = opt.param_groups[0]["lr"]
                got["sched"] = sched.state_dict()["last_epoch"]
                got["before"] = Before(g)  # what UpdateMarks.began takes, here
            opt.step()
            sched.step()
            opt.zero_grad()
            if g.step == 4:
                got["batch"] = x
                got["lr_after"] = opt.param_groups[0]["lr"]
                got["opt"] = opt
    return got


def test_a_save_a_step_behind_takes_the_host_state_from_before_the_update(tmp_path):
    got = _run(tmp_path, lambda p: torch.optim.SGD(p, lr=0.1))
    point, why = got["point"]
    assert why == "" and point is not None
    assert point.step == 3 and point.before is not None and not point.after_update
    # The scheduler and the optimizer's lr as they were before step 4's update, not
    # after it (the scheduler moved both on since).
    [sched] = point.scheduler_states.values()
    assert sched["last_epoch"] == got["sched"] == 3
    assert got["lr_after"] != got["lr"]
    assert point.optimizer_state(got["opt"])["param_groups"][0]["lr"] == got["lr"]
    # Step 3's boundary: its RNG streams and data position, and step 4's batch, fetched
    # past it, handed out again on resume.
    assert point.position[0] == got["trained_at"] != got["now_trained_at"]
    assert any(b is not None and torch.equal(b[0], got["batch"]) for b in point.position[1])
    for name, state in got["rng"].items():
        if isinstance(state, torch.Tensor):
            assert torch.equal(point.rng[name], state), name
        else:
            assert point.rng[name] == state, name


def test_an_optimizer_that_keeps_state_on_the_host_cannot_go_back_a_step(tmp_path):
    """AdamW without fused=True counts its steps in CPU tensors, which the host's update
    already moved past the GPU's: nothing is saved, and the reason names the fix."""
    point, why = _run(tmp_path, lambda p: torch.optim.AdamW(p, lr=0.1))["point"]
    assert point is None
    assert "a step behind its host" in why and "fused=True" in why and "step" in why


class _SlowScheduler(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler whose state_dict() blocks (a custom one that reads a file on a slow
    mount, say): the failure save's copy of the state cannot finish."""

    def state_dict(self):
        time.sleep(30)
        return super().state_dict()


def test_a_failure_save_past_its_limit_ends_and_says_where_it_was(tmp_path):
    """The run's own error comes out once the save's limit has passed, while the save
    is still blocked; the event says it ran out, what it was doing and where."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = _SlowScheduler(opt, lambda s: 1.0)
    batches = [(torch.randn(2, 4),) for _ in range(4)]
    with pytest.raises(ValueError, match="boom"):
        with guardrails.guard(
            model,
            opt,
            batches,
            scheduler=sched,
            run_dir=tmp_path,
            progress=False,
            checkpoint={"failure_save_timeout_s": 1.0},
        ) as g:
            for (x,) in g:
                if g.step == 2:
                    raise ValueError("boom")
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    # The error came out while the scheduler still blocked (it was not waited for).
    [saved] = [e for e in read_events(tmp_path) if e["kind"] == "failure_saved"]
    assert saved["path"] is None and saved["staged_s"] is None, saved
    why = saved["why"]
    assert "did not finish within failure_save_timeout_s=1 s" in why, why
    assert "still copying its state" in why and "(state_dict)" in why, why
    assert "test_savepoint.py" in why, why
