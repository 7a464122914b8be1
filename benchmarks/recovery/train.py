"""The loop under test: a deterministic data-parallel job on gloo, plain or guarded, clock-logged.

    torchrun ... benchmarks/recovery/train.py --arm plain|guardrails --run-dir DIR --steps N

Run by ``driver.py`` (see ``benchmarks/recovery/README.md``); both arms run the same model,
the same batches (drawn from the step index, so a resume needs no data position) and the
same per-step collectives, and differ only in how they save, resume and fail:

* ``plain``: rank 0 ``torch.save``s model + optimizer + step every ``--ckpt-every-s`` (written
  to a temporary name, then renamed), every rank loads the newest file at start, the process
  group's timeout is ``--hang-timeout-s``, and a non-finite mean loss raises.
* ``guardrails``: ``@guardrails.record`` + ``with guardrails.guard(...)``, the defaults plus
  ``checkpoint={"every_s": ...}``, ``watchdog={"hang_timeout_s": ...}``, ``resume="auto"``.

Faults come from outside (the driver): SIGUSR2 makes this rank sleep forever inside its next
step (a hang); the file ``RUN_DIR/nan`` makes rank 0's loss NaN for ``--nan-steps`` steps
(the gradient all-reduce carries it to every rank's gradients); SIGKILL and SIGTERM are
themselves.

Each rank appends its clock (``time.time()``) to ``RUN_DIR/log/rankR.jsonl``: ``start`` (the
process began), ``resumed`` (state loaded, at step S), ``step`` (step S finished, its own
seconds ``dt``), ``error`` (an exception left the loop), ``done``. The benchmark reads only
these, never guardrails' own report.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the imports: the process's start, as near as Python sees it

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

WIDTH = 256
BATCH = 32


class ClockLog:
    """One rank's JSON-lines file of events, each with the wall clock; flushed per line."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        (run_dir / "log").mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "log" / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
        self.pid = os.getpid()

    def write(self, ev: str, t: float | None = None, **fields: object) -> None:
        row = {"ev": ev, "t": time.time() if t is None else t, "pid": self.pid, **fields}
        self.file.write(json.dumps(row) + "\n")


class Faults:
    """What the driver injects: a hang on SIGUSR2, a NaN streak from a flag file (rank 0)."""

    def __init__(self, run_dir: Path, rank: int, nan_steps: int) -> None:
        self.hang = False
        self.nan_flag = run_dir / "nan" if rank == 0 else None
        self.stop_flag = run_dir / "stop"
        self.nan_steps = nan_steps
        self.nan_left = 0
        signal.signal(signal.SIGUSR2, self._on_usr2)

    def _on_usr2(self, signum: int, frame: object) -> None:
        self.hang = True

    def loss_is_nan(self) -> bool:
        """Whether this step's loss is made NaN; the flag file is consumed when first seen."""
        if self.nan_flag is not None and self.nan_flag.exists():
            self.nan_flag.unlink()
            self.nan_left = self.nan_steps
        if self.nan_left > 0:
            self.nan_left -= 1
            return True
        return False


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` on ``rank``: a function of both, so a resume needs no data state."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    return x, x[:, :1].sin()


def average_grads(model: nn.Module) -> None:
    """Every gradient summed across ranks, one all-reduce each, in parameter order: the same
    sums in the same order at every step of every attempt, in both arms. DDP's buckets are
    rebuilt after an attempt's first step, so the plain arm's resumed DDP run would sum some
    gradients in another order than an uninterrupted one (guardrails' resume gives the
    saved buckets back)."""
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def one_step(a, net, opt, step, rank, faults, log) -> tuple[bool, bool, float]:
    """Forward, mean loss across ranks, backward, update; paced to ``--step-s``.

    Returns whether the driver asked the job to stop after this step, whether its loss was
    made NaN, and its seconds."""
    t0 = time.time()
    x, y = batch(step, rank)
    nan = faults.loss_is_nan()
    loss = nn.functional.mse_loss(net(x), y)
    if nan:
        loss = loss * float("nan")
    if faults.hang:  # a rank stuck inside its step: its peers wait in the next all-reduce
        log.write("hang", step=step)
        while True:
            time.sleep(1.0)
    # The mean loss most loops log (the plain arm's NaN check), and the driver's stop file
    # seen by any rank: one all-reduce, so every rank stops after the same step.
    stop_seen = float(rank == 0 and faults.stop_flag.exists())
    both = torch.stack([loss.detach(), torch.tensor(stop_seen)])
    dist.all_reduce(both)
    if a.arm == "plain" and not torch.isfinite(both[0]):
        raise FloatingPointError(f"loss is {both[0].item()} at step {step}")
    # The rest of a GPU-bound step, before the gradients' all-reduce: a real step's time
    # is its forward and backward, the all-reduce ends with the backward (DDP overlaps
    # them), and the update is a few percent. Paced after the all-reduce instead, most
    # kills landed between a rank's last collective and its step boundary, a window a
    # real step barely has.
    time.sleep(max(0.0, a.step_s - (time.time() - t0)))
    loss.backward()
    if a.sync == "allreduce":
        average_grads(net)
    opt.step()  # under guardrails, a non-finite step is skipped here (g.step stays)
    opt.zero_grad(set_to_none=True)
    return bool(both[1] > 0), nan, time.time() - t0


def plain_resume(a, model, opt, log) -> int:
    ckpts = sorted(Path(a.run_dir, "plain_ckpt").glob("step*.pt"))
    if not ckpts:
        log.write("resumed", step=0)
        return 0
    state = torch.load(ckpts[-1], map_location="cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    log.write("resumed", step=state["step"], file=ckpts[-1].name)
    return state["step"]


def plain_save(a, model, opt, step: int, log) -> None:
    folder = Path(a.run_dir, "plain_ckpt")
    folder.mkdir(exist_ok=True)
    t0 = time.time()
    tmp = folder / f".step{step:08d}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, folder / f"step{step:08d}.pt")
    for old in sorted(folder.glob("step*.pt"))[:-2]:  # keep the newest two
        old.unlink()
    log.write("saved", step=step, save_s=time.time() - t0)


def run_plain(a, model, net, opt, rank, faults, log) -> int:
    step = plain_resume(a, model, opt, log)
    last_save = time.time()
    while step < a.steps:
        stop, nan, dt = one_step(a, net, opt, step, rank, faults, log)
        step += 1
        log.write("step", step=step, dt=dt, nan=nan)
        if stop:
            break
        if rank == 0 and time.time() - last_save >= a.ckpt_every_s:
            plain_save(a, model, opt, step, log)
            last_save = time.time()
    return step


def run_guarded(a, model, net, opt, rank, faults, log) -> int:
    import guardrails

    with guardrails.guard(
        net,
        opt,
        run_dir=a.run_dir,
        resume="auto",
        progress=False,
        checkpoint={"every_s": a.ckpt_every_s},
        watchdog={"hang_timeout_s": a.hang_timeout_s},
    ) as g:
        step = g.step
        log.write("resumed", step=step)
        while step < a.steps:
            # The batch is the step's: a skipped step (its update never made) leaves g.step
            # as it was, and the next iteration trains the same batch, as a loader resumed
            # from g.step would give it. A skipped step changes no state at all, so the
            # weights are those of the plain loop's steps 1..g.step, bitwise.
            stop, nan, dt = one_step(a, net, opt, step, rank, faults, log)
            step = g.step
            log.write("step", step=step, dt=dt, nan=nan)
            if stop:
                break
    return step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=["plain", "guardrails"], required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-s", type=float, default=0.2, help="pace each step to this long")
    p.add_argument("--ckpt-every-s", type=float, default=200.0)
    p.add_argument("--hang-timeout-s", type=float, default=30.0)
    p.add_argument("--nan-steps", type=int, default=10)
    p.add_argument(
        "--sync",
        choices=["allreduce", "ddp"],
        default="allreduce",
        help="how gradients are averaged: one all-reduce a parameter (deterministic across "
        "resumes), or DistributedDataParallel (its bucket rebuild is not)",
    )
    p.add_argument("--final", default=None, help="rank 0 saves the final weights here")
    return p.parse_args()


def main(a: argparse.Namespace) -> None:
    run_dir = Path(a.run_dir)
    rank = int(os.environ["RANK"])
    log = ClockLog(run_dir, rank)
    log.write("start", t=T_START)
    (run_dir / "pids").mkdir(exist_ok=True)
    (run_dir / "pids" / f"rank{rank}.pid").write_text(str(os.getpid()))
    faults = Faults(run_dir, rank, a.nan_steps)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.hang_timeout_s))
    model = make_model()
    net = DistributedDataParallel(model) if a.sync == "ddp" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        if a.arm == "plain":
            step = run_plain(a, model, net, opt, rank, faults, log)
        else:
            step = run_guarded(a, model, net, opt, rank, faults, log)
    except BaseException as e:
        log.write("error", kind=type(e).__name__, msg=str(e)[:300])
        raise
    if rank == 0 and a.final:
        torch.save(model.state_dict(), a.final)
    log.write("done", step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    if args.arm == "guardrails":
        import guardrails

        guardrails.record(main)(args)
    else:
        main(args)
