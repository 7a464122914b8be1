"""A guarded training script whose disk fails under it, run as a real process.

    python tests/storage_worker.py RUN_DIR --fail HOW --fail-at K [--heal-at K2]
        [--steps N] [--every-n N] [--keep-last N] [--sigterm-at K] [--background]
        [--slow-step K]
        [--resave] [--max-pending-rows N]

``--fail`` makes every write under RUN_DIR fail from step K on (0: before the guard
starts), through the OS, with no privileges needed for the first:

* ``fsize``: ``setrlimit(RLIMIT_FSIZE, 0)`` with SIGXFSZ ignored: any write to a file
  fails with EFBIG (the process may raise the limit back: ``--heal-at``);
* ``fill``: RUN_DIR is a small tmpfs (the test mounts it in a user namespace); a
  ballast file fills it to the last byte: ENOSPC (``--heal-at`` deletes the ballast);
* ``ro``: RUN_DIR is a tmpfs remounted read-only: EROFS (``--heal-at`` remounts it
  read-write).

With ``--world W --rank R --port P`` it is one rank of a DDP job (gloo), and only the
ranks in ``--fail-ranks`` have a failing disk. With ``--sigterm-at K`` the process
sends itself SIGTERM after step K; ``--slow-step K`` makes step K take a second longer
(a background save in flight has finished, or failed, by its end). ``--resave``: no
training; resume, then save the step just resumed again (``g.save_checkpoint()``).
At the end it prints one JSON line (``summary: {...}``) with what is on disk, read
back after the guard closed: a tmpfs in a user namespace is gone once this process
ends, so the test reads the outcome here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import Regressor, batches

import guardrails
from guardrails.metrics import events as events_file


class Disk:
    def __init__(self, how: str, run_dir: Path) -> None:
        self.how = how
        self.run_dir = run_dir
        self.ballast = run_dir / "ballast"
        self.failing = False

    def fail(self) -> None:
        self.failing = True
        if self.how == "fsize":
            # The limit is for every file of the process: torch finds its temp dir (by
            # writing a probe file) when dynamo is imported; found now, it is cached.
            tempfile.gettempdir()
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        elif self.how == "fill":
            fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            for block in (65536, 1):  # to the last byte: ENOSPC
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * block)
            os.close(fd)
        elif self.how == "ro":
            for d in self._read_only():
                # A remount read-only is refused while a file is open for writing
                # (the events file is); a read-only bind mount of a directory is not.
                _mount("--bind", d, d)
                _mount("-o", "remount,bind,ro", d)

    def heal(self) -> None:
        self.failing = False
        if self.how == "fsize":
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        elif self.how == "fill":
            self.ballast.unlink()
        elif self.how == "ro":
            for d in self._read_only():
                _mount("-o", "remount,bind,rw", d)

    def _read_only(self) -> list[Path]:
        """Before the guard: all of RUN_DIR (then nothing under it can be created);
        during the run: the checkpoints and the metrics."""
        if not events_file.event_files(self.run_dir):
            return [self.run_dir]
        return [self.run_dir / "checkpoints", self.run_dir / "metrics.parquet"]


def _mount(*args: object) -> None:
    subprocess.run(["mount", *map(str, args)], check=True)


def summary(run_dir: Path, g: guardrails.Guard | None, error: BaseException | None) -> dict:
    """What is on disk, and what a resume gets from it."""
    import pyarrow.parquet as pq

    from guardrails.checkpoint.manifest import MANIFEST

    ckpts = run_dir / "checkpoints"
    out: dict = {
        "step": None if g is None else g.step,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "entries": sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else [],
        "committed": sorted(p.name for p in ckpts.glob("step_*") if (p / MANIFEST).is_file()),
    }
    metrics = run_dir / "metrics.parquet"
    parts = sorted(metrics.glob("*.parquet")) if metrics.is_dir() else []
    out["metric_steps"] = sorted(pq.read_table(parts).column("step").to_pylist()) if parts else []
    out["metric_leftovers"] = sorted(p.name for p in metrics.glob(".*")) if parts else []
    out["events"] = events_file.read_events(run_dir)
    if out["committed"]:
        torch.manual_seed(1)
        try:
            out["resumed_step"] = guardrails.resume(ckpts, Regressor())["step"]
        except guardrails.GuardrailsError as e:
            out["resumed_step"] = f"{type(e).__name__}: {e}"
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", type=Path)
    p.add_argument("--fail", choices=("fsize", "fill", "ro"))
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--heal-at", type=int, default=-1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every-n", type=int, default=5)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--sigterm-at", type=int, default=-1)
    p.add_argument("--slow-step", type=int, default=-1)
    p.add_argument("--background", action="store_true")
    p.add_argument("--resave", action="store_true")
    p.add_argument("--max-pending-rows", type=int, default=None)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--fail-ranks", default="0", help="the ranks whose disk fails")
    a = p.parse_args()
    if a.world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    if a.max_pending_rows is not None:
        from guardrails.guards import telemetry

        telemetry.MAX_PENDING_ROWS = a.max_pending_rows
    failing = a.rank in {int(r) for r in a.fail_ranks.split(",")}
    disk = Disk(a.fail, a.run_dir) if a.fail and failing else None
    if disk is not None and a.fail_at == 0:
        disk.fail()
    torch.manual_seed(0)
    model: torch.nn.Module = Regressor()
    if a.world > 1:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = None
    error = None
    try:
        with guardrails.guard(
            model,
            opt,
            batches(a.steps),
            run_dir=a.run_dir,
            progress=False,
            gc=False,
            metrics={"every_n_steps": 2, "write_every_s": 0},
            checkpoint={
                "every_n_steps": None if a.resave else a.every_n,
                "background": a.background,
                "keep_last": a.keep_last,
            },
        ) as g:
            if a.resave:
                g.save_checkpoint()
            else:
                # Not train_loop: the disk fails, slows and heals at given steps, inside the loop.
                for x, y in g:
                    model(x, y).backward()
                    opt.step()
                    opt.zero_grad()
                    if disk is not None and g.step == a.fail_at:
                        disk.fail()
                    if g.step == a.slow_step:
                        time.sleep(1.0)
                    if disk is not None and g.step == a.heal_at:
                        disk.heal()
                    if g.step == a.sigterm_at:
                        os.kill(os.getpid(), signal.SIGTERM)
    except BaseException as e:  # reported in the summary, then raised as it was
        error = e
        raise
    finally:
        if disk is not None and disk.failing:
            disk.heal()  # to read back (and resume) what is there
        print("summary: " + json.dumps(summary(a.run_dir, g, error), default=str), flush=True)
        if a.world > 1 and error is None:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
