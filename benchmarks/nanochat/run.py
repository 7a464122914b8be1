"""Run karpathy/nanochat's real ``scripts/base_train.py`` on CPU, 2 ranks (gloo, torchrun),
unguarded and with guardrails adopted, plus planted faults; report what happened.

    .venv/bin/python benchmarks/nanochat/run.py [--scenarios clean,sigterm,...] [--out DIR]

Not part of the test suite (nanochat is not on PyPI and needs a compiler for its
torch.compile'd model and optimizer): run it by hand. See README.md here.

Two copies of nanochat are prepared in the work directory, both with ``cpu_gloo.patch``
(nanochat only initializes a process group on CUDA) and ``hooks.patch`` (the harness's
``GR_INJECT`` faults): ``unguarded/`` as is, ``guarded/`` with ``adopt.patch`` on top.
Every run writes its own guardrails run dir (``$NANOCHAT_BASE_DIR/guardrails/<tag>``)
and nanochat's own final checkpoint (``$NANOCHAT_BASE_DIR/base_checkpoints/<tag>/
model_<N>.pt``, rank 0's ``orig_model.state_dict()``), which is what gets compared.

Step numbers: nanochat's ``step`` is the 0-based index of the step being taken; the
guard counts completed steps. A fault planted at nanochat step S shows up in the guard's
events as step S + 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MIRROR = Path("/work/.mirror/karpathy+nanochat/repo")
SCENARIOS = ("clean", "sigterm", "lr_blowup", "nan_sample")
EXIT_SIGTERM = 143  # 128 + SIGTERM: a guarded rank after its signal save
EXIT_NONFINITE = 81  # guardrails/_exit.py: NonFiniteError (through @guardrails.record)
NAN_ROW = 3  # hooks.patch poisons sample row 3
WORLD = 2

sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import setup_data  # noqa: E402  (the sibling module, found through the line above)
from _realscript import (  # noqa: E402  (benchmarks/, found through the line above)
    compare,
    guardrails_version,
    key_lines,
    patched_trees,
    rank_exit_codes,
    read_events,
)
from _realscript import exits as _exits  # noqa: E402


def train_flags(steps: int) -> list[str]:
    """The smallest nanochat: 2 layers of 128 (2 heads of 64), 64-token rows, 4 rows per
    rank per micro-batch, 1024 tokens per step = 2 micro-batches (gradient accumulation)
    on 2 ranks; full attention (SDPA has no sliding window); no eval, CORE or sampling."""
    return [
        "--device-type=cpu",
        "--depth=2",
        "--aspect-ratio=64",
        "--head-dim=64",
        "--window-pattern=L",
        "--max-seq-len=64",
        "--device-batch-size=4",
        "--total-batch-size=1024",
        f"--num-iterations={steps}",
        "--warmup-steps=5",
        "--eval-every=-1",
        "--core-metric-every=-1",
        "--sample-every=-1",
    ]


# ---------------------------------------------------------------------- setup


def prepare_trees(work: Path, nanochat: Path | None) -> tuple[dict[str, Path], str]:
    """Extract nanochat twice and patch it; returns the trees and nanochat's commit."""
    source = work / "source"
    if source.exists():
        shutil.rmtree(source)
    if nanochat is None:
        git = ["git", f"--git-dir={MIRROR}"]
        commit = subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()
        source.mkdir(parents=True)
        archive = subprocess.run([*git, "archive", "HEAD"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    else:
        probe = ["git", "-C", str(nanochat), "rev-parse", "HEAD"]
        done = subprocess.run(probe, capture_output=True, text=True)
        known = done.returncode == 0 and (nanochat / ".git").exists()  # not a parent repo's
        commit = done.stdout.strip() if known else "unknown"
        shutil.copytree(nanochat, source, ignore=shutil.ignore_patterns(".git", ".venv"))
    variants = {
        "unguarded": ["cpu_gloo.patch", "hooks.patch"],
        "guarded": ["cpu_gloo.patch", "hooks.patch", "adopt.patch"],
    }
    return patched_trees(source, work, HERE, variants), commit


# ---------------------------------------------------------------------- one run


class Bench:
    def __init__(self, args: argparse.Namespace, trees: dict[str, Path]) -> None:
        self.trees = trees
        self.base_dir = args.work / "base"
        self.out = args.out
        self.steps = args.steps
        self.fault_step = args.fault_step
        self.timeout = args.timeout
        self.torchrun = Path(sys.executable).parent / "torchrun"
        self._reference: dict[str, Any] | None = None

    def run_dir(self, tag: str) -> Path:
        return self.base_dir / "guardrails" / tag

    def fresh(self, tag: str) -> None:
        for d in (self.run_dir(tag), self.base_dir / "base_checkpoints" / tag):
            shutil.rmtree(d, ignore_errors=True)

    def run(self, tag: str, *, guarded: bool, inject: str | None = None, log: str = "") -> dict:
        """One torchrun of base_train (2 ranks), its outputs saved to OUT/<log or tag>.*"""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GR_")}
        env.update(
            NANOCHAT_BASE_DIR=str(self.base_dir),
            OMP_NUM_THREADS="1",  # 2 ranks share the cores
            PYTHONUNBUFFERED="1",
            # torch's deprecation notes for the collectives nanochat calls, every step
            PYTHONWARNINGS="ignore::FutureWarning",
            # This checkout's guardrails, not whatever the venv has installed (an
            # editable install of another worktree): the ranks run in nanochat's tree.
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        )
        if guarded:
            env["GR_RECORD"] = "1"  # launch.py: @guardrails.record, exit codes per error
        if inject:
            env["GR_INJECT"] = inject
        cmd = [
            str(self.torchrun),
            "--standalone",
            f"--nproc-per-node={WORLD}",
            str(HERE / "launch.py"),
            *train_flags(self.steps),
            f"--model-tag={tag}",
        ]
        name = log or tag
        stdout, stderr = self.out / f"{name}.stdout.txt", self.out / f"{name}.stderr.txt"
        tree = self.trees["guarded" if guarded else "unguarded"]
        print(f"  {name}: {'GR_INJECT=' + inject + ' ' if inject else ''}torchrun ...", flush=True)
        t0, t_start = time.monotonic(), time.time()
        with open(stdout, "w") as fo, open(stderr, "w") as fe:
            # Own session: on a timeout the whole group (torchrun and its ranks) is killed.
            proc = subprocess.Popen(
                cmd, cwd=tree, env=env, stdout=fo, stderr=fe, start_new_session=True
            )
            try:
                rc: int | None = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        wall = time.monotonic() - t0
        err = stderr.read_text(errors="replace")
        # This run's events only (a resumed run shares its run dir with the first one).
        events = [e for e in read_events(self.run_dir(tag)) if e.get("time", 0) >= t_start]
        if events:
            with open(self.out / f"{name}.events.jsonl", "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in events)
        result = {
            "tag": tag,
            "name": name,
            "command": " ".join(
                [f"{k}={env[k]}" for k in ("GR_INJECT", "GR_RECORD") if k in env] + cmd[1:]
            ),
            "cwd": str(tree),
            "torchrun_rc": rc,
            "timed_out": rc is None,
            "rank_exit_codes": rank_exit_codes(err, rc, WORLD),
            "wall_s": round(wall, 1),
            "key_lines": key_lines(err),
            # @guardrails.record's summary, one per failing rank: which error it raised
            "failed_with": {
                int(r): cls
                for r, cls in re.findall(r"guardrails: rank (\d+) failed with (\w+)", err)
            },
            "nonfinite": [brief(e) for e in events if e["kind"].startswith("nonfinite")],
            "stopped": [brief(e) for e in events if e["kind"] == "stopped"],
            "resumed": [brief(e) for e in events if e["kind"] == "resumed"],
            "end_events": [brief(e) for e in events if e["kind"] == "end"],
            "checkpoints": sorted(
                p.name for p in (self.run_dir(tag) / "checkpoints").glob("step_*")
            ),
            "logs": [str(stdout), str(stderr)],
        }
        print(
            f"    rc={rc} ranks={result['rank_exit_codes']} {wall:.0f}s",
            flush=True,
        )
        return result

    def weights(self, tag: str) -> dict | None:
        import torch

        path = self.base_dir / "base_checkpoints" / tag / f"model_{self.steps:06d}.pt"
        return torch.load(path, map_location="cpu") if path.exists() else None

    def reference(self) -> dict[str, Any]:
        """The uninterrupted guarded run (clean's guarded half), run once."""
        if self._reference is None:
            self.fresh("clean-guarded")
            self._reference = self.run("clean-guarded", guarded=True)
        return self._reference


# ---------------------------------------------------------------------- reading


def first_error(run: dict) -> str:
    """The most telling error line of a failed run: an exception with its message, else
    guardrails' one-line summary."""
    lines = run["key_lines"]
    return next(
        (k for k in lines if re.search(r"\w+(Error|Exception): ", k)),
        next((k for k in lines if "Error" in k), "(no error line)"),
    )


def brief(e: dict) -> dict:
    """The parts of an event that matter here."""
    keys = ("rank", "step", "kind", "cause", "samples", "tensor", "module", "message", "error")
    return {k: e[k] for k in keys if e.get(k) is not None}


def contrast(b: Bench, base: dict) -> str:
    """What the same fault did to the unguarded run (for the reader, not pass/fail)."""
    import torch

    sd = b.weights(base["tag"])
    if sd is None:
        return f" (unguarded: rc {base['torchrun_rc']}, no final weights)"
    bad = sum(not bool(torch.isfinite(t).all()) for t in sd.values())
    return (
        f" (unguarded, same fault: rc {base['torchrun_rc']}, "
        f"{bad}/{len(sd)} final weight tensors hold NaN/Inf)"
    )


# ---------------------------------------------------------------------- scenarios


def exits(run: dict, code: int, ranks_done: set[int], what: str) -> tuple[bool, str]:
    """Did every rank end with ``code`` (see ``_realscript.exits``)?"""
    return _exits(run["rank_exit_codes"], code, ranks_done, what, WORLD)


def clean(b: Bench) -> dict:
    """Unguarded vs guarded, same flags: final weights bitwise equal."""
    b.fresh("clean-unguarded")
    runs = [b.run("clean-unguarded", guarded=False), b.reference()]
    same, why = compare(b.weights("clean-unguarded"), b.weights("clean-guarded"))
    ok = all(r["torchrun_rc"] == 0 for r in runs) and same
    return {"passed": ok, "reason": why, "runs": runs}


def sigterm(b: Bench) -> dict:
    """SIGTERM on rank 1: both ranks save and exit 143; the same command resumes from the
    checkpoint and ends bitwise equal to the uninterrupted guarded run."""
    ref = b.reference()
    b.fresh("sigterm-guarded")
    inject = f"sigterm@{b.fault_step}:1"
    first = b.run("sigterm-guarded", guarded=True, inject=inject, log="sigterm-guarded-1")
    # The same command again, without GR_INJECT: the checkpoint may be at nanochat step
    # fault_step itself (the guard stops at the prefetch's next()), which would fire again.
    second = b.run("sigterm-guarded", guarded=True, log="sigterm-guarded-2-resume")
    stopped = {e["rank"] for e in first["stopped"]}
    codes_ok, text = exits(first, EXIT_SIGTERM, stopped, "stopped and saved")
    reasons = [f"interrupted run: {text}"]
    reasons.append(f"checkpoints {first['checkpoints'] or 'none'}")
    # A run that started over from step 0 would end with the same weights too: the
    # resume must be seen (a `resumed` event on every rank).
    resumed = sorted({(e["rank"], e["step"]) for e in second["resumed"]})
    resumed_ok = sorted(r for r, _ in resumed) == list(range(WORLD))
    if second["torchrun_rc"] != 0:
        line = first_error(second)
        reasons.append(f"resume failed (rc {second['torchrun_rc']}): {line[:300]}")
    else:
        reasons.append(f"resumed (rank, step): {resumed or 'NOT resumed, started over'}")
    same, why = compare(b.weights("clean-guarded"), b.weights("sigterm-guarded"))
    if second["torchrun_rc"] == 0:
        reasons.append(("" if same else "NOT ") + "bitwise equal to the uninterrupted run: " + why)
    ok = codes_ok and bool(first["checkpoints"]) and resumed_ok and same
    if ref["torchrun_rc"] != 0:
        ok = False
        reasons.append("the uninterrupted reference run failed")
    return {"passed": ok, "reason": "; ".join(reasons), "runs": [first, second]}


def lr_blowup(b: Bench) -> dict:
    """LR 1e4 from fault_step on: skipped steps, then NonFiniteError (exit 81) with cause
    optimization_blowup. The unguarded run is there for contrast."""
    b.fresh("lr_blowup-guarded")
    b.fresh("lr_blowup-unguarded")
    inject = f"lr_blowup@{b.fault_step}"
    run = b.run("lr_blowup-guarded", guarded=True, inject=inject)
    base = b.run("lr_blowup-unguarded", guarded=False, inject=inject)
    causes = {e.get("cause") for e in run["nonfinite"] if e["kind"] == "nonfinite"}
    text = "\n".join(run["key_lines"])
    raised = {r for r, cls in run["failed_with"].items() if cls == "NonFiniteError"}
    codes_ok, reason = exits(run, EXIT_NONFINITE, raised, "raised NonFiniteError")
    ok = codes_ok and "optimization_blowup" in text and causes == {"optimization_blowup"}
    skipped = re.search(r"steps (\d+-\d+), all skipped", text)
    reason += f"; nonfinite causes {sorted(map(str, causes))}"
    reason += f"; skipped steps {skipped[1]}" if skipped else ""
    return {"passed": ok, "reason": reason + contrast(b, base), "runs": [run, base]}


def nan_sample(b: Bench) -> dict:
    """One NaN sample (row 3) on rank 1 at fault_step: that step skipped on both ranks,
    rank 1's nonfinite event names the row, the run finishes (exit 0)."""
    b.fresh("nan_sample-guarded")
    b.fresh("nan_sample-unguarded")
    inject = f"nan_sample@{b.fault_step}:1"
    run = b.run("nan_sample-guarded", guarded=True, inject=inject)
    base = b.run("nan_sample-unguarded", guarded=False, inject=inject)
    step = b.fault_step + 1  # the guard's number for nanochat's step fault_step
    hits = [e for e in run["nonfinite"] if e["kind"] == "nonfinite"]
    reasons = []
    if run["torchrun_rc"] != 0:
        reasons.append(f"run failed: rank exit codes {run['rank_exit_codes']}")
    ranks_skipped = sorted(e["rank"] for e in hits if e["step"] == step)
    if ranks_skipped != list(range(WORLD)):
        reasons.append(f"step {step} skipped on ranks {ranks_skipped}, not on every rank")
    others = sorted({e["step"] for e in hits} - {step})
    if others:
        reasons.append(f"other non-finite steps {others}")
    mine = [e for e in hits if e["rank"] == 1 and e["step"] == step]
    named = any(
        NAN_ROW in (e.get("samples") or []) or re.search(rf"rows?\S* \[?{NAN_ROW}\b", e["message"])
        for e in mine
    )
    if mine:
        e = mine[0]
        verdict = "names" if named else "does NOT name"
        reasons.append(
            f"rank 1's event {verdict} sample row {NAN_ROW}: "
            f"cause={e.get('cause')}: {e['message'][:300]}"
        )
    else:
        reasons.append("no nonfinite event from rank 1")
    ok = run["torchrun_rc"] == 0 and ranks_skipped == list(range(WORLD)) and not others and named
    return {"passed": ok, "reason": "; ".join(reasons) + contrast(b, base), "runs": [run, base]}


# ---------------------------------------------------------------------- report


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "# nanochat + guardrails, CPU, 2 ranks (gloo)",
        "",
        f"nanochat {meta['nanochat_commit']}; guardrails HEAD {meta['guardrails']['head'][:12]}"
        f" ({meta['guardrails']['uncommitted_files']} uncommitted file(s) in guardrails/, "
        f"sources {meta['guardrails']['sources_sha256']}); torch {meta['torch']}; "
        f"{meta['steps']} steps, faults at nanochat step {meta['fault_step']} "
        f"(guard step {meta['fault_step'] + 1})",
        "",
        "| scenario | result | time | runs: torchrun rc / rank exit codes | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in results["scenarios"].items():
        runs = "<br>".join(
            f"{r['name']}{' (timeout)' if r['timed_out'] else ''}: {r['torchrun_rc']} / "
            + ", ".join(f"r{k}={v}" for k, v in r["rank_exit_codes"].items())
            for r in s["runs"]
        )
        why = s["reason"].replace("|", "\\|").replace("\n", " ")
        verdict = "PASS" if s["passed"] else "FAIL"
        lines.append(f"| {name} | {verdict} | {s['time_s']:.0f} s | {runs} | {why} |")
    lines += ["", "## Key lines per run", ""]
    for name, s in results["scenarios"].items():
        for r in s["runs"]:
            lines.append(f"**{name} / {r['name']}** (`{r['logs'][1]}`)")
            lines.append("")
            lines += [f"    {k}" for k in r["key_lines"]] or ["    (none)"]
            lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    p.add_argument("--nanochat", type=Path, help="a nanochat tree (default: the mirror's HEAD)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="results and logs")
    p.add_argument("--work", type=Path, help="trees, data, run dirs (default: a new temp dir)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--fault-step", type=int, help="nanochat step of the faults (default: half)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per torchrun")
    args = p.parse_args()
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    args.fault_step = args.fault_step if args.fault_step is not None else args.steps // 2
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="nanochat-guardrails-"))).resolve()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    print(f"work dir {args.work}; results in {args.out}", flush=True)
    trees, commit = prepare_trees(args.work, args.nanochat)
    print(f"nanochat {commit}; preparing data and tokenizer", flush=True)
    setup_data.setup(trees["unguarded"], args.work / "base", python=sys.executable)
    bench = Bench(args, trees)
    results: dict[str, Any] = {
        "meta": {
            "nanochat_commit": commit,
            "guardrails": guardrails_version(),
            "torch": torch.__version__,
            "steps": args.steps,
            "fault_step": args.fault_step,
            "flags": train_flags(args.steps),
            "work_dir": str(args.work),
        },
        "scenarios": {},
    }
    for name in wanted:
        print(f"{name}:", flush=True)
        t0 = time.monotonic()
        outcome = globals()[name](bench)
        outcome["time_s"] = round(time.monotonic() - t0, 1)
        results["scenarios"][name] = outcome
        print(f"  -> {'PASS' if outcome['passed'] else 'FAIL'}: {outcome['reason']}", flush=True)
        # Written after every scenario, so an interrupted harness keeps what it has.
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "results.md").write_text(markdown(results))
    print()
    print(markdown(results).split("\n## ")[0])
    print(f"details: {args.out / 'results.md'}, {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
