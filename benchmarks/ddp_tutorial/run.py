"""Run pytorch/examples' DDP tutorial script (``distributed/ddp-tutorial-series/
multigpu_torchrun.py``) under torchrun, 2 gloo ranks on CPU, with a DataLoader of 2
workers and a DistributedSampler: unguarded and with guardrails adopted, then stopped by
a real SIGTERM to torchrun (or a SIGINT to the whole process group, as Ctrl+C sends it)
and run again with the same command. Reports what happened in each.

    .venv/bin/python benchmarks/ddp_tutorial/run.py [--scenarios clean,sigterm,sigint] [--out DIR]

Not part of the test suite (pytorch/examples is not on PyPI): run it by hand. The tree
comes from the mirror ``/work/.mirror/pytorch+examples/repo`` (or ``--examples DIR``).
Three patches, applied with ``git apply``: ``cpu_workers.patch`` (gloo on CPU, a seed so
two runs are comparable, ``num_workers=2``, the final weights dumped for the harness),
``adopt.patch`` (the guardrails adoption: the loop over ``g``, ``range(g.epoch, ...)``,
``@guardrails.record``), ``hooks.patch`` (rank 0 sends the signal at a given step; every
line marked ``# harness``).

The script trains ``Linear(20, 1)`` with SGD on 2,048 random samples, batch 32: 32 steps
an epoch on each of 2 ranks. ``--epochs 4`` is 128 steps; the signal comes at step 48,
in the middle of the second epoch, while the loader's workers are running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _realscript import (
    compare,
    guardrails_version,
    key_lines,
    patched_trees,
    rank_exit_codes,
    read_events,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MIRROR = Path("/work/.mirror/pytorch+examples/repo")
FOLDER = "distributed/ddp-tutorial-series"
SCENARIOS = ("as_is", "clean", "sigterm", "sigint")


def prepare_trees(work: Path, examples: Path | None) -> tuple[dict[str, Path], str]:
    """The tutorial's folder twice: ``unguarded`` (cpu_workers.patch) and ``guarded``
    (cpu_workers, adopt, hooks); returns the trees and pytorch/examples' commit."""
    source = work / "source"
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    if examples is None:
        git = ["git", f"--git-dir={MIRROR}"]
        commit = subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()
        archive = subprocess.run([*git, "archive", "HEAD", FOLDER], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
        folder = source / FOLDER
    else:
        commit = "unknown"
        folder = examples / FOLDER
    variants = {
        "unguarded": ["cpu_workers.patch"],
        "guarded": ["cpu_workers.patch", "adopt.patch", "hooks.patch"],
    }
    return patched_trees(folder, work, HERE, variants), commit


class Bench:
    def __init__(self, args: argparse.Namespace, trees: dict[str, Path]) -> None:
        self.trees, self.out, self.args = trees, args.out, args
        self.runs = args.work / "runs"
        self.torchrun = Path(sys.executable).parent / "torchrun"

    def cwd(self, tag: str) -> Path:
        """Each tag runs in a folder of its own: the script writes ``snapshot.pt`` and the
        guard ``runs/ddp`` relative to it."""
        return self.runs / tag

    def run(
        self, tag: str, *, guarded: bool, signal_at: str | None = None, mse: bool = True
    ) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GR_")}
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
            GR_DUMP=str(self.runs / tag),
        )
        if signal_at:
            env["GR_SIGNAL_AT"] = signal_at
        if mse:
            env["GR_MSE"] = "1"
        tree = self.trees["guarded" if guarded else "unguarded"]
        cmd = [
            str(self.torchrun),
            "--standalone",
            "--nproc-per-node=2",
            str(tree / "multigpu_torchrun.py"),
            str(self.args.epochs),
            "1000",  # save_every: the script's own snapshot only at epoch 0
        ]
        self.cwd(tag).mkdir(parents=True, exist_ok=True)
        n = len(list(self.out.glob(f"{tag}-*.stderr.txt")))
        name = f"{tag}-{n + 1}"
        stdout, stderr = self.out / f"{name}.stdout.txt", self.out / f"{name}.stderr.txt"
        print(f"  {name}: {'GR_SIGNAL_AT=' + signal_at + ' ' if signal_at else ''}...", flush=True)
        t0, t_start = time.monotonic(), time.time()
        with open(stdout, "w") as fo, open(stderr, "w") as fe:
            # Own session, so that SIGINT to rank 0's process group (hooks.patch) reaches
            # torchrun and every rank, as a terminal's Ctrl+C does, and nothing beyond.
            proc = subprocess.Popen(
                cmd, cwd=self.cwd(tag), env=env, stdout=fo, stderr=fe, start_new_session=True
            )
            try:
                rc: int | None = proc.wait(timeout=self.args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        err = stderr.read_text(errors="replace")
        run_dir = self.cwd(tag) / "runs" / "ddp"
        events = [e for e in read_events(run_dir) if e.get("time", 0) >= t_start]
        with open(self.out / f"{name}.events.jsonl", "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)
        ckpts = run_dir / "checkpoints"
        result = {
            "name": name,
            "command": " ".join(cmd),
            "rc": rc,
            "rank_exit_codes": rank_exit_codes(err, rc, 2),
            "wall_s": round(time.monotonic() - t0, 1),
            "key_lines": key_lines(err),
            "stopped": [e.get("step") for e in events if e["kind"] == "stopped"],
            "resumed": [e.get("step") for e in events if e["kind"] == "resumed"],
            "warnings": sorted({e["kind"] for e in events if e.get("level") == "warning"}),
            "end": [e.get("message", "")[:200] for e in events if e["kind"] == "end"],
            "checkpoints": sorted(p.name for p in ckpts.glob("step_*")) if ckpts.exists() else [],
        }
        print(f"    rc={rc} ranks={result['rank_exit_codes']} {result['wall_s']}s", flush=True)
        return result

    def dump(self, tag: str, rank: int) -> dict | None:
        import torch

        path = self.runs / f"{tag}.rank{rank}.pt"
        return torch.load(path, map_location="cpu") if path.exists() else None


def as_is(b: Bench) -> dict:
    """The tutorial's own loss, ``F.cross_entropy`` over a single output, is 0 whatever the
    weights: nothing trains. The guard must say so (``zero_grads``, ``loss_not_decreasing``),
    and the weights stay bitwise those of the unguarded run."""
    runs = [b.run("as_is_plain", guarded=False, mse=False), b.run("as_is", guarded=True, mse=False)]
    checks = [compare(b.dump("as_is_plain", r), b.dump("as_is", r)) for r in (0, 1)]
    want = ["loss_not_decreasing", "zero_grads"]
    ok = all(c[0] for c in checks) and all(r["rc"] == 0 for r in runs)
    ok = ok and runs[1]["warnings"] == want
    why = "; ".join(f"rank {r}: {c[1]}" for r, c in enumerate(checks))
    why += f"; guarded warnings: {runs[1]['warnings']} (want {want})"
    return {"ok": ok, "why": why, "runs": runs}


def clean(b: Bench) -> dict:
    """Unguarded vs guarded: the final weights of both ranks bitwise equal; no warning."""
    runs = [b.run("plain", guarded=False), b.run("guarded", guarded=True)]
    checks = [compare(b.dump("plain", r), b.dump("guarded", r)) for r in (0, 1)]
    ok = all(c[0] for c in checks) and all(r["rc"] == 0 for r in runs)
    ok = ok and not runs[1]["warnings"]
    why = "; ".join(f"rank {r}: {c[1]}" for r, c in enumerate(checks))
    why += f"; guarded warnings: {runs[1]['warnings'] or 'none'}"
    return {"ok": ok, "why": why, "runs": runs}


def _stop(b: Bench, sig: str) -> dict:
    """The signal from rank 0 at step 48 (mid-epoch 2, workers running): every rank stops
    at one step and exits ``code`` with a checkpoint (torchrun itself exits 1 on a signal it
    received: its own ``SignalException``); the same command resumes and ends bitwise equal
    to the guarded run never stopped."""
    tag = f"stop_{sig.lower()}"
    first = b.run(tag, guarded=True, signal_at=f"{sig}@{b.args.signal_step}")
    second = b.run(tag, guarded=True)
    if not (b.runs / "guarded.rank0.pt").exists():
        clean(b)
    checks = [compare(b.dump("guarded", r), b.dump(tag, r)) for r in (0, 1)]
    stopped = first["stopped"]
    ok = (
        len(stopped) == 2
        and len(set(stopped)) == 1
        and bool(first["checkpoints"])
        and second["rc"] == 0
        and bool(second["resumed"])
        and all(c[0] for c in checks)
    )
    why = (
        f"first run rc {first['rc']} (torchrun's), ranks stopped at {stopped}, checkpoints "
        f"{first['checkpoints']}; second run rc {second['rc']}, resumed at {second['resumed']}; "
        + "; ".join(f"rank {r} vs never stopped: {c[1]}" for r, c in enumerate(checks))
    )
    return {"ok": ok, "why": why, "runs": [first, second]}


def sigterm(b: Bench) -> dict:
    return _stop(b, "TERM")


def sigint(b: Bench) -> dict:
    return _stop(b, "INT")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--examples", type=Path, default=None, help="a pytorch/examples checkout")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--signal-step", type=int, default=48)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    args.work = args.work or Path(tempfile.mkdtemp(prefix="ddpt-"))
    args.out.mkdir(parents=True, exist_ok=True)
    trees, commit = prepare_trees(args.work, args.examples)
    b = Bench(args, trees)
    results: dict[str, Any] = {
        "examples_commit": commit,
        "guardrails": guardrails_version(),
        "scenarios": {},
    }
    for name in args.scenarios.split(","):
        print(name, flush=True)
        results["scenarios"][name] = r = globals()[name](b)
        print(f"  {'PASS' if r['ok'] else 'FAIL'}: {r['why']}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results in {args.out}; work dir {args.work}")


if __name__ == "__main__":
    main()
