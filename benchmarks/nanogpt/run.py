"""Run karpathy/nanoGPT's real ``train.py`` tiny on CPU, 1 process and 2 ranks (torchrun,
gloo), unguarded and with guardrails adopted, plus planted faults; report what happened.

    .venv/bin/python benchmarks/nanogpt/run.py [--scenarios clean,sigterm,...] [--out DIR]

Not part of the test suite (nanoGPT is not on PyPI): run it by hand. See README.md here.

Two copies of nanoGPT are prepared in the work directory, both with ``cpu_gloo.patch``
(nanoGPT's DDP path puts every rank on ``cuda:<local_rank>``) and ``hooks.patch`` (the
harness's ``GR_INJECT`` faults and ``GR_DUMP`` of the final weights and of the norms
``clip_grad_norm_`` returned): ``unguarded/`` as is, ``guarded/`` with ``adopt.patch`` on
top. The guarded runs go through ``python -m guardrails run train.py`` (``torchrun ... -m
guardrails.run train.py``): nanoGPT's train.py is a flat script with no ``main()`` to
decorate, and that is how guardrails runs one under ``@guardrails.record``.

Step numbers: nanoGPT's ``iter_num`` is the 0-based index of the step being taken; the
guard counts completed steps. A fault planted at iter S shows up as guard step S + 1;
``--max_iters=60`` runs iters 0..60, 61 steps.
"""

from __future__ import annotations

import argparse
import json
import math
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _realscript import compare as _compare
from _realscript import exits as _exits
from _realscript import (
    guardrails_version,
    key_lines,
    patched_trees,
    rank_exit_codes,
    read_events,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MIRROR = Path("/work/.mirror/karpathy+nanoGPT/repo")
TEXT = REPO / "examples" / "data" / "shakespeare.txt"  # instead of prepare.py's download
SCENARIOS = (
    "clean",
    "sigterm",
    "sigterm_eval",
    "nan_sample",
    "lr_blowup",
    "nan_run_rewind",
    "ddp_clean",
    "ddp_sigterm",
    "ddp_nan_sample",
    "nodes_clean",
    "nodes_lost",
)
EXIT_SIGTERM = 143  # 128 + SIGTERM: a guarded rank after its signal save
EXIT_NONFINITE = 81  # guardrails/_exit.py: NonFiniteError (through guardrails.run)
NAN_ROW = 3  # hooks.patch poisons sample row 3
EVAL_EVERY = 30  # sigterm_eval: nanoGPT evaluates at iters 0, 30, 60
#: --device: nanoGPT's --device for every run (the DDP ones are untried on a GPU);
#: --grad-clip 0 turns nanoGPT's clipping off, so the guard takes its own norm.
OPTS = {"device": "cpu", "grad_clip": None}


def train_flags(steps: int, eval_interval: int) -> list[str]:
    """config/train_shakespeare_char.py shrunk: 2 layers of 64 (2 heads), 64-char rows,
    8 rows per micro-batch, 4 micro-batches per step (2 per rank on 2 ranks: gradient
    accumulation with DDP's require_backward_grad_sync toggling), dropout 0.2 as the
    config has it, float32 (the GradScaler is built disabled), no compile; eval only at
    iter 0 unless asked (2 batches per split)."""
    clip = OPTS["grad_clip"]
    return [
        "config/train_shakespeare_char.py",
        f"--device={OPTS['device']}",
        "--backend=gloo",
        *([f"--grad_clip={clip}"] if clip is not None else []),
        "--compile=False",
        "--dtype=float32",
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=64",
        "--block_size=64",
        "--batch_size=8",
        "--gradient_accumulation_steps=4",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        "--warmup_iters=5",
        f"--eval_interval={eval_interval}",
        "--eval_iters=2",
        "--log_interval=10",
    ]


# ---------------------------------------------------------------------- setup


def prepare_trees(work: Path, nanogpt: Path | None) -> tuple[dict[str, Path], str]:
    """Extract nanoGPT, write its shakespeare_char data with its own prepare.py (from a
    local text: nothing is downloaded), copy it twice and patch; returns the trees and
    nanoGPT's commit."""
    source = work / "source"
    if source.exists():
        shutil.rmtree(source)
    if nanogpt is None:
        git = ["git", f"--git-dir={MIRROR}"]
        commit = subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()
        source.mkdir(parents=True)
        archive = subprocess.run([*git, "archive", "HEAD"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    else:
        probe = ["git", "-C", str(nanogpt), "rev-parse", "HEAD"]
        done = subprocess.run(probe, capture_output=True, text=True)
        known = done.returncode == 0 and (nanogpt / ".git").exists()  # not a parent repo's
        commit = done.stdout.strip() if known else "unknown"
        shutil.copytree(nanogpt, source, ignore=shutil.ignore_patterns(".git"))
    data = source / "data" / "shakespeare_char"
    # prepare.py downloads input.txt only when it is missing.
    shutil.copyfile(TEXT, data / "input.txt")
    subprocess.run(
        [sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True, text=True
    )
    variants = {
        "unguarded": ["cpu_gloo.patch", "hooks.patch"],
        "guarded": ["cpu_gloo.patch", "hooks.patch", "adopt.patch"],
    }
    return patched_trees(source, work, HERE, variants), commit


# ---------------------------------------------------------------------- one run


def free_port() -> int:
    """A port nothing listens on now (each multi-node run's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bench:
    def __init__(self, args: argparse.Namespace, trees: dict[str, Path]) -> None:
        self.trees = trees
        self.runs = args.work / "runs"
        self.out = args.out
        self.steps = args.steps
        self.fault = args.fault_iter
        self.timeout = args.timeout
        self.torchrun = Path(sys.executable).parent / "torchrun"
        self._refs: dict[tuple[int, int], dict[str, Any]] = {}

    def out_dir(self, tag: str) -> Path:
        """nanoGPT's --out_dir for this tag; the guard's run_dir is its guardrails/."""
        return self.runs / tag

    def run_dir(self, tag: str) -> Path:
        return self.out_dir(tag) / "guardrails"

    def fresh(self, tag: str) -> None:
        shutil.rmtree(self.out_dir(tag), ignore_errors=True)
        for f in self.runs.glob(f"{tag}.rank*.pt"):
            f.unlink()

    def run(
        self,
        tag: str,
        *,
        guarded: bool,
        world: int = 1,
        inject: str | None = None,
        eval_interval: int = 100_000,
        log: str = "",
        rewind: dict[str, Any] | None = None,
        nodes: int = 1,
    ) -> dict[str, Any]:
        """One run of train.py (``world`` 1: python; more: torchrun), its outputs saved to
        OUT/<log or tag>.*; ``rewind``: ``guard(rewind=...)``'s knobs (hooks.patch's
        ``GR_REWIND``); ``nodes``: simulated nodes, a torchrun agent each (static
        rendezvous: node ``n`` runs ranks ``n * world / nodes`` on)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GR_")}
        env.update(
            OMP_NUM_THREADS="1",  # the same kernels in every run; 2 ranks share 2 cores
            PYTHONUNBUFFERED="1",
            # nanoGPT's torch.cuda.amp.GradScaler(enabled=False): a deprecation note
            PYTHONWARNINGS="ignore::FutureWarning",
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
            GR_DUMP=str(self.runs / tag),
        )
        if inject:
            env["GR_INJECT"] = inject
        if rewind is not None:
            env["GR_REWIND"] = json.dumps(rewind)
        script = ["-m", "guardrails.run", "train.py"] if guarded else ["train.py"]
        if world == 1:
            launcher = [sys.executable]
        elif nodes == 1:
            launcher = [str(self.torchrun), "--standalone", f"--nproc-per-node={world}"]
        else:
            # Not loopback: guardrails' launch check refuses a loopback MASTER_ADDR on a
            # node other than the first, as it should on real nodes.
            addr = (
                subprocess.check_output(["hostname", "-I"], text=True).split() or ["localhost"]
            )[0]
            launcher = [str(self.torchrun), f"--nnodes={nodes}", "--node-rank={node}"]
            launcher += [f"--nproc-per-node={world // nodes}", f"--master-addr={addr}"]
            launcher += [f"--master-port={free_port()}", f"--local-addr={addr}"]
        flags = train_flags(self.steps, eval_interval)
        cmd = [*launcher, *script, *flags, f"--out_dir={self.out_dir(tag)}"]
        name = log or tag
        stdout, stderr = self.out / f"{name}.stdout.txt", self.out / f"{name}.stderr.txt"
        tree = self.trees["guarded" if guarded else "unguarded"]
        how = "torchrun" if world > 1 else "python"
        print(f"  {name}: {'GR_INJECT=' + inject + ' ' if inject else ''}{how} ...", flush=True)
        self.runs.mkdir(parents=True, exist_ok=True)
        t0, t_start = time.monotonic(), time.time()
        with open(stdout, "w") as fo, open(stderr, "w") as fe:
            # Own session: on a timeout the whole group (torchrun and its ranks) is killed.
            procs = [
                subprocess.Popen(
                    [a.replace("{node}", str(n)) for a in cmd],
                    cwd=tree,
                    env=env,
                    stdout=fo,
                    stderr=fe,
                    start_new_session=True,
                )
                for n in range(nodes)
            ]
            deadline = time.monotonic() + self.timeout
            rc: int | None = 0
            for proc in procs:
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                    rc = rc or code  # the first agent's failure is the run's
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = None
                    break
            for proc in procs:  # the others, when one timed out
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
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
            "world": world,
            "nodes": nodes,
            "command": " ".join(
                [f"{k}={env[k]!r}" for k in ("GR_INJECT", "GR_REWIND") if k in env]
                + [Path(cmd[0]).name, *cmd[1:]]
            ),
            "cwd": str(tree),
            "rc": rc,
            "timed_out": rc is None,
            "rank_exit_codes": rank_exit_codes(err, rc, world),
            "wall_s": round(wall, 1),
            "key_lines": key_lines(err),
            "stdout_evals": re.findall(r"^step (\d+): train loss", stdout.read_text(), re.M),
            # guardrails.run's summary, one per failing rank: which error it raised
            "failed_with": {
                int(r): cls
                for r, cls in re.findall(r"guardrails: rank (\d+) failed with (\w+)", err)
            },
            "nonfinite": [brief(e) for e in events if e["kind"].startswith("nonfinite")],
            "stopped": [brief(e) for e in events if e["kind"] == "stopped"],
            "rewinds": [e for e in events if e["kind"].startswith("rewind")],
            "resumed": [brief(e) for e in events if e["kind"] == "resumed"],
            "shared_norm": [brief(e) for e in events if e["kind"] == "grad_norm_shared"],
            "kernel_norm": [brief(e) for e in events if e["kind"] == "grad_norm_kernel"],
            "warnings": [brief(e) for e in events if e.get("level") in ("warning", "error")],
            "end_events": [brief(e) for e in events if e["kind"] == "end"],
            "checkpoints": sorted(
                p.name for p in (self.run_dir(tag) / "checkpoints").glob("step_*")
            ),
            "t_start": t_start,
            "logs": [str(stdout), str(stderr)],
        }
        print(f"    rc={rc} ranks={result['rank_exit_codes']} {wall:.0f}s", flush=True)
        return result

    def dump(self, tag: str, rank: int = 0) -> dict | None:
        """hooks.patch's GR_DUMP: {'model': final state dict, 'iters', 'norms'}."""
        import torch

        path = self.runs / f"{tag}.rank{rank}.pt"
        return torch.load(path, map_location="cpu") if path.exists() else None

    def reference(self, world: int, eval_interval: int = 100_000, nodes: int = 1) -> dict[str, Any]:
        """The uninterrupted guarded run (clean's guarded half), run once per shape."""
        key = (world, eval_interval, nodes)
        if key not in self._refs:
            prefix = "" if world == 1 else "ddp_" if nodes == 1 else "nodes_"
            suffix = "" if eval_interval == 100_000 else "_eval"
            tag = f"{prefix}clean{suffix}-guarded"
            self.fresh(tag)
            self._refs[key] = self.run(
                tag, guarded=True, world=world, eval_interval=eval_interval, nodes=nodes
            )
        return self._refs[key]


# ---------------------------------------------------------------------- reading


def brief(e: dict) -> dict:
    """The parts of an event that matter here."""
    keys = (
        "rank",
        "step",
        "kind",
        "level",
        "cause",
        "samples",
        "module",
        "evidence",
        "source",
        "steps",
        "message",
        "error",
        "failed",
    )
    return {k: e[k] for k in keys if e.get(k) is not None}


def compare(a: dict | None, b: dict | None) -> tuple[bool, str]:
    """Bitwise equality of two final dumps' models (torch.equal on every tensor)."""
    return _compare(None if a is None else a["model"], None if b is None else b["model"])


def same_floats(a: list[float], b: list[float]) -> bool:
    """Equal as float32 values, NaN equal to NaN (a skipped step's norm)."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


def norms_check(b: Bench, run: dict, rank: int, steps: int) -> tuple[bool, str]:
    """The guard's grad norms: the grad_norm_shared event (source clip_grad_norm_, one
    per step of this run), and metrics.parquet's grad_norm, step by step, against the
    norms nanoGPT's clip_grad_norm_ returned (hooks.patch logs them)."""
    import guardrails

    shared = [e for e in run["shared_norm"] if e["rank"] == rank]
    got = [(e.get("source"), e.get("steps")) for e in shared]
    if OPTS["grad_clip"] == 0:  # no clip to share: the guard's own norm, every step
        table = guardrails.read_metrics(b.run_dir(run["tag"])).to_pylist()
        rows = sorted(
            (r["step"], r["grad_norm"])
            for r in table
            if r["rank"] == rank and r["started_at"] >= run["t_start"] - 1
        )
        ok = not got and [s for s, _ in rows] == list(range(1, steps + 1))
        ok &= all(math.isfinite(v) and v > 0 for _, v in rows)
        kernel = [
            (e.get("steps"), e.get("failed")) for e in run["kernel_norm"] if e["rank"] == rank
        ]
        if OPTS["device"].startswith("cuda"):  # one GPU: the guard's kernel took every norm
            ok &= kernel == [(steps, None)]
        return ok, (
            f"rank {rank}: no clip, no grad_norm_shared ({got or 'none'}); grad_norm_kernel "
            f"(steps, failed) {kernel}; metrics grad_norm at {len(rows)} of {steps} steps, "
            f"all finite and > 0: {ok}"
        )
    event_ok = got == [("clip_grad_norm_", steps)]
    dump = b.dump(run["tag"], rank)
    table = guardrails.read_metrics(b.run_dir(run["tag"]))
    rows = [
        r for r in table.to_pylist() if r["rank"] == rank and r["started_at"] >= run["t_start"] - 1
    ]
    rows.sort(key=lambda r: r["step"])
    if dump is None or dump["norms"] is None:
        return False, f"rank {rank}: no norms logged by the patched script"
    logged = [float(x) for x in dump["norms"].tolist()]
    first = dump["iters"][0] + 1  # the guard's number of nanoGPT's first logged iter
    metric = [r["grad_norm"] for r in rows]
    steps_ok = [r["step"] for r in rows] == list(range(first, first + len(logged)))
    metrics_ok = steps_ok and same_floats(metric, logged)
    last = first + len(logged) - 1
    text = f"rank {rank}: grad_norm_shared {got or 'none'}; metrics grad_norm " + (
        f"== clip_grad_norm_'s return at all {len(logged)} steps ({first}-{last})"
        if metrics_ok
        else f"DIFFERS from clip_grad_norm_'s ({len(rows)} rows vs {len(logged)} norms)"
    )
    return event_ok and metrics_ok, text


def unwarned(run: dict, allowed: set[str] = frozenset()) -> tuple[bool, str]:
    """No warning event beyond the ``allowed`` kinds (no false alarms)."""
    extra = [e for e in run["warnings"] if e["kind"] not in allowed]
    if not extra:
        return True, "no other warning"
    return False, "unexpected warnings: " + "; ".join(
        f"[rank {e['rank']} step {e['step']}] {e['kind']}: {e.get('message', '')[:160]}"
        for e in extra
    )


def contrast(b: Bench, base: dict) -> str:
    """What the same fault did to the unguarded run (for the reader, not pass/fail)."""
    import torch

    d = b.dump(base["tag"])
    if d is None:
        return f" (unguarded: rc {base['rc']}, no final weights)"
    bad = sum(not bool(torch.isfinite(t).all()) for t in d["model"].values())
    return (
        f" (unguarded, same fault: rc {base['rc']}, "
        f"{bad}/{len(d['model'])} final weight tensors hold NaN/Inf)"
    )


# ---------------------------------------------------------------------- scenarios


def exits(run: dict, code: int, ranks_done: set[int], what: str) -> tuple[bool, str]:
    """Did every rank end with ``code`` (see ``_realscript.exits``)?"""
    return _exits(run["rank_exit_codes"], code, ranks_done, what, run["world"])


def _clean(b: Bench, world: int, nodes: int = 1) -> dict:
    prefix = "" if world == 1 else "ddp_" if nodes == 1 else "nodes_"
    tag = f"{prefix}clean-unguarded"
    b.fresh(tag)
    plain = b.run(tag, guarded=False, world=world, nodes=nodes)
    ref = b.reference(world, nodes=nodes)
    steps = b.steps + 1
    reasons, ok = [], plain["rc"] == 0 and ref["rc"] == 0
    for rank in range(world):
        same, why = compare(b.dump(tag, rank), b.dump(ref["tag"], rank))
        ok &= same
        reasons.append(f"rank {rank} unguarded vs guarded: {why}")
    if world > 1:
        same, why = compare(b.dump(ref["tag"], 0), b.dump(ref["tag"], 1))
        ok &= same
        reasons.append(f"guarded rank 0 vs rank 1: {why}")
    for rank in range(world):
        good, why = norms_check(b, ref, rank, steps)
        ok &= good
        reasons.append(why)
    quiet, why = unwarned(ref)
    ok &= quiet
    reasons.append(why)
    return {"passed": ok, "reason": "; ".join(reasons), "runs": [plain, ref]}


def clean(b: Bench) -> dict:
    """Unguarded vs guarded, 1 process: final weights bitwise equal; the guard's norm is
    clip_grad_norm_'s at every step; no warning."""
    return _clean(b, 1)


def ddp_clean(b: Bench) -> dict:
    """The same under torchrun, 2 ranks, gloo (nanoGPT's DDP path)."""
    return _clean(b, 2)


def nodes_clean(b: Bench) -> dict:
    """4 ranks on 2 simulated nodes (a torchrun agent each): each rank's part also goes
    to a rank on the other node at every step (checkpointer/partner.py). Unguarded vs
    guarded bitwise, no warning."""
    return _clean(b, 4, nodes=2)


def nodes_lost(b: Bench) -> dict:
    """The second of 2 simulated nodes lost whole at iter fault_iter: ranks 2 and 3
    SIGKILLed 0.3 s into the step, the copies they held in /dev/shm removed (the node's
    memory). The survivors' failure save is whole (ranks 2 and 3's parts from the copies
    their partners on node 0 kept); the same command again resumes it, redoing no step,
    and every rank ends bitwise the uninterrupted guarded run."""
    import json as _json

    world, nodes = 4, 2
    ref = b.reference(world, nodes=nodes)
    tag = "nodes_lost-guarded"
    b.fresh(tag)
    inject = f"node_lost@{b.fault}:2,3"
    first = b.run(tag, guarded=True, world=world, inject=inject, log=tag + "-1", nodes=nodes)
    second = b.run(tag, guarded=True, world=world, log=tag + "-2", nodes=nodes)
    reasons = [f"ranks 2,3 (node 1) lost at iter {b.fault}: exit codes {first['rank_exit_codes']}"]
    # The failure save: the checkpoint with a failure record (the resumed run's own
    # saves come after it).
    saves = [p for p in sorted((b.run_dir(tag) / "checkpoints").glob("step_*")) if p.is_dir()]
    failed = [
        (p, f)
        for p in saves
        if (f := _json.loads((p / "manifest.json").read_text()).get("failure"))
    ]
    saved, failure = failed[-1] if failed else (None, {})
    whole = bool(failure) and failure.get("missing") == [] and failure.get("from_peers") == [2, 3]
    reasons.append(
        f"failure save {saved.name if saved else 'none'}: missing "
        f"{failure.get('missing')}, from_peers {failure.get('from_peers')}"
    )
    saved_step = int(saved.name.split("_")[1]) if saved else -1
    resumed = sorted({(e["rank"], e["step"]) for e in second["resumed"]})
    resumed_ok = resumed == [(r, saved_step) for r in range(world)]
    reasons.append(f"resumed (rank, step): {resumed or 'NOT resumed'}")
    ok = whole and resumed_ok and second["rc"] == 0 and ref["rc"] == 0
    for r in range(world):
        same, why = compare(b.dump(ref["tag"], r), b.dump(tag, r))
        ok &= same
        reasons.append(
            f"rank {r} {'' if same else 'NOT '}bitwise equal to the uninterrupted run: {why}"
        )
    quiet, why = unwarned(second)
    ok &= quiet
    reasons.append("resumed run: " + why)
    return {"passed": ok, "reason": "; ".join(reasons), "runs": [first, second]}


def _sigterm(b: Bench, world: int, eval_interval: int = 100_000) -> dict:
    ref = b.reference(world, eval_interval)
    prefix = "" if world == 1 else "ddp_"
    suffix = "" if eval_interval == 100_000 else "_eval"
    tag = f"{prefix}sigterm{suffix}-guarded"
    b.fresh(tag)
    rank = world - 1
    inject = f"sigterm@{b.fault}:{rank}"
    first = b.run(
        tag, guarded=True, world=world, inject=inject, eval_interval=eval_interval, log=tag + "-1"
    )
    # The same command again, without GR_INJECT (the checkpoint is at the fault's iter).
    second = b.run(tag, guarded=True, world=world, eval_interval=eval_interval, log=tag + "-2")
    stopped = {e["rank"] for e in first["stopped"]}
    codes_ok, text = exits(first, EXIT_SIGTERM, stopped, "stopped and saved")
    reasons = [f"SIGTERM to rank {rank} at iter {b.fault}: {text}"]
    reasons.append(f"checkpoints {first['checkpoints'] or 'none'}")
    # A run that started over from step 0 would end with the same weights too: the
    # resume must be seen (a `resumed` event on every rank).
    resumed = sorted({(e["rank"], e["step"]) for e in second["resumed"]})
    resumed_ok = sorted(r for r, _ in resumed) == list(range(world))
    if second["rc"] != 0:
        line = next((k for k in second["key_lines"] if "Error" in k), "(no error line)")
        reasons.append(f"resume failed (rc {second['rc']}): {line[:300]}")
    else:
        reasons.append(f"resumed (rank, step): {resumed or 'NOT resumed, started over'}")
    ok = codes_ok and bool(first["checkpoints"]) and resumed_ok and second["rc"] == 0
    for r in range(world):
        same, why = compare(b.dump(ref["tag"], r), b.dump(tag, r))
        ok &= same
        reasons.append(
            f"rank {r} {'' if same else 'NOT '}bitwise equal to the uninterrupted run: {why}"
        )
        # The resumed half's norms are the uninterrupted run's, step by step.
        a, c = b.dump(ref["tag"], r), b.dump(tag, r)
        if a is not None and c is not None and c["iters"]:
            pairs = zip(a["iters"], a["norms"].tolist(), strict=True)
            tail = [float(x) for i, x in pairs if i >= c["iters"][0]]
            norms_same = same_floats(tail, [float(x) for x in c["norms"].tolist()])
            ok &= norms_same
            reasons.append(
                f"rank {r} grad norms of iters {c['iters'][0]}-{c['iters'][-1]} "
                + ("equal" if norms_same else "DIFFER from")
                + " the uninterrupted run's"
            )
    if eval_interval != 100_000:
        # adopt.patch's eval line: a resumed process does not evaluate its first iter
        # again (it was evaluated before the stop); the uninterrupted run's evals are
        # the two halves' together.
        evals = first["stdout_evals"] + second["stdout_evals"]
        evals_ok = evals == ref["stdout_evals"]
        ok &= evals_ok
        reasons.append(
            f"nanoGPT's evals at iters {'+'.join(first['stdout_evals'])} then "
            f"{'+'.join(second['stdout_evals']) or 'none'} "
            + ("==" if evals_ok else "!=")
            + f" the uninterrupted run's {'+'.join(ref['stdout_evals'])}"
        )
    quiet, why = unwarned(second)  # its fast-forward (0.1 s) is an info event
    ok &= quiet
    reasons.append("resumed run: " + why)
    if ref["rc"] != 0:
        ok = False
        reasons.append("the uninterrupted reference run failed")
    return {"passed": ok, "reason": "; ".join(reasons), "runs": [first, second]}


def sigterm(b: Bench) -> dict:
    """SIGTERM at iter fault_iter: exit 143 with a checkpoint; the same command resumes
    and ends bitwise equal to the uninterrupted guarded run."""
    return _sigterm(b, 1)


def sigterm_eval(b: Bench) -> dict:
    """The same, with nanoGPT evaluating at the iter the stop comes at (eval_interval
    30): the eval draws from the RNG before the checkpoint is taken, so the resumed
    process must not run it again (adopt.patch's eval line)."""
    return _sigterm(b, 1, EVAL_EVERY)


def ddp_sigterm(b: Bench) -> dict:
    """SIGTERM to rank 1 of 2: both stop and save at one step; the resume is bitwise."""
    return _sigterm(b, 2)


def _nan_sample(b: Bench, world: int) -> dict:
    prefix = "" if world == 1 else "ddp_"
    tag, base_tag = f"{prefix}nan_sample-guarded", f"{prefix}nan_sample-unguarded"
    b.fresh(tag)
    b.fresh(base_tag)
    rank = world - 1
    inject = f"nan_sample@{b.fault}:{rank}"
    run = b.run(tag, guarded=True, world=world, inject=inject)
    base = b.run(base_tag, guarded=False, world=world, inject=inject)
    step = b.fault + 1  # the guard's number for nanoGPT's iter fault
    hits = [e for e in run["nonfinite"] if e["kind"] == "nonfinite"]
    reasons = []
    if run["rc"] != 0:
        reasons.append(f"run failed: exit codes {run['rank_exit_codes']}")
    ranks_skipped = sorted(e["rank"] for e in hits if e["step"] == step)
    reasons.append(f"step {step} skipped on ranks {ranks_skipped}")
    others = sorted({e["step"] for e in hits} - {step})
    if others:
        reasons.append(f"other non-finite steps {others}")
    mine = [e for e in hits if e["rank"] == rank and e["step"] == step]
    named = any(
        NAN_ROW in (e.get("samples") or []) or re.search(rf"rows?\S* \[?{NAN_ROW}\b", e["message"])
        for e in mine
    )
    for e in sorted(hits, key=lambda e: e["rank"]):
        reasons.append(f"rank {e['rank']}: cause={e.get('cause')}: {e['message'][:260]}")
    if not mine:
        reasons.append(f"no nonfinite event from rank {rank}")
    elif not named:
        reasons.append(f"rank {rank}'s event does NOT name sample row {NAN_ROW}")
    # Every rank's event of that step, the shared-norm event on each, no stray warning.
    shared = sorted((e["rank"], e.get("steps")) for e in run["shared_norm"])
    clips = OPTS["grad_clip"] != 0  # no clip: nothing to share, the guard's own norm
    shared_ok = shared == ([(r, b.steps + 1) for r in range(world)] if clips else [])
    reasons.append(f"grad_norm_shared (rank, steps) {shared}")
    quiet, why = unwarned(run, {"nonfinite"})
    reasons.append(why)
    ok = (
        run["rc"] == 0
        and ranks_skipped == list(range(world))
        and not others
        and named
        and shared_ok
        and quiet
    )
    return {"passed": ok, "reason": "; ".join(reasons) + contrast(b, base), "runs": [run, base]}


def nan_sample(b: Bench) -> dict:
    """One NaN sample (row 3) at iter fault_iter: that step skipped, the row named, the
    run finishes (exit 0)."""
    return _nan_sample(b, 1)


def ddp_nan_sample(b: Bench) -> dict:
    """The NaN sample on rank 1 of 2: the step skipped on both ranks, rank 1 names the
    row, rank 0 says another rank's data; the run finishes."""
    return _nan_sample(b, 2)


def lr_blowup(b: Bench) -> dict:
    """LR 1e4 from iter fault_iter on: skipped steps, then NonFiniteError (exit 81)
    with cause optimization_blowup, naming the LR jump at guard step fault_iter + 1
    first. The unguarded run is there for contrast."""
    tag, base_tag = "lr_blowup-guarded", "lr_blowup-unguarded"
    b.fresh(tag)
    b.fresh(base_tag)
    inject = f"lr_blowup@{b.fault}"
    run = b.run(tag, guarded=True, inject=inject)
    base = b.run(base_tag, guarded=False, inject=inject)
    causes = {e.get("cause") for e in run["nonfinite"] if e["kind"] == "nonfinite"}
    text = "\n".join(run["key_lines"])
    raised = {r for r, cls in run["failed_with"].items() if cls == "NonFiniteError"}
    codes_ok, reason = exits(run, EXIT_NONFINITE, raised, "raised NonFiniteError")
    ok = codes_ok and "optimization_blowup" in text and causes == {"optimization_blowup"}
    # The diagnosis names the LR jump, at the step it came (iter S is guard step S + 1).
    jumps = {
        (e.get("evidence") or {}).get("lr_jump", {}).get("step")
        for e in run["nonfinite"]
        if e["kind"] == "nonfinite"
    }
    named = "the learning rate jumped from" in text and f"to 1e+04 at step {b.fault + 1}" in text
    ok = ok and jumps == {b.fault + 1} and named
    skipped = re.search(r"steps (\d+-\d+), all skipped", text)
    reason += f"; nonfinite causes {sorted(map(str, causes))}"
    reason += f"; LR jump named at step(s) {sorted(map(str, jumps))}"
    reason += f"; skipped steps {skipped[1]}" if skipped else ""
    error = next((k for k in run["key_lines"] if re.match(r"\[rank \d+, step \d+\] ", k)), "")
    fix = next((k for k in run["key_lines"] if k.startswith("fix: ")), "")
    reason += f"; {error[:400]} {fix}" if error else ""
    return {"passed": ok, "reason": reason + contrast(b, base), "runs": [run, base]}


def nan_run_rewind(b: Bench) -> dict:
    """A run of 12 bad batches from iter fault_iter (sample row 3 of each step's first
    micro-batch NaN) with ``guard(rewind=...)`` on: the streak of 10 skipped steps
    rewinds every rank to the snapshot before it instead of NonFiniteError, the batches
    are skipped, and the run finishes (exit 0) with finite weights. Without rewind the
    same fault ends in NonFiniteError (exit 81), for contrast."""
    tag, base_tag = "nan_run-rewind", "nan_run-norewind"
    b.fresh(tag)
    b.fresh(base_tag)
    inject = f"nan_run@{b.fault}"
    knobs = {"snapshot_every_steps": 10, "skip_batches": 8}
    run = b.run(tag, guarded=True, inject=inject, rewind=knobs)
    base = b.run(base_tag, guarded=True, inject=inject)
    rewinds = [e for e in run["rewinds"] if e["kind"] == "rewind"]
    start = b.fault + 1  # the guard's number of nanoGPT's iter fault_iter
    reasons = [f"rc {run['rc']}; without rewind rc {base['rc']}"]
    ok = run["rc"] == 0 and base["rc"] == EXIT_NONFINITE and len(rewinds) == 1
    if rewinds:
        e = rewinds[0]
        ok = ok and e["cause"] == "nonfinite" and e["start"] == start and e["to_step"] < start
        reasons.append(
            f"rewind: cause {e['cause']}, start {e['start']}, from step {e['from_step']} to "
            f"{e['to_step']}, batches {e['batches_skipped']}: {e['message'][:400]}"
        )
    else:
        reasons.append("no rewind event")
    import torch

    d = b.dump(tag)
    finite = d is not None and all(bool(torch.isfinite(t).all()) for t in d["model"].values())
    ok = ok and finite
    reasons.append("final weights finite" if finite else "final weights missing or NaN")
    quiet, why = unwarned(run, {"nonfinite", "rewind"})
    reasons.append(why)
    return {"passed": ok and quiet, "reason": "; ".join(reasons), "runs": [run, base]}


# ---------------------------------------------------------------------- report


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "# nanoGPT + guardrails, CPU (1 process; 2 ranks under torchrun, gloo)",
        "",
        f"nanoGPT {meta['nanogpt_commit']}; guardrails HEAD {meta['guardrails']['head'][:12]}"
        f" ({meta['guardrails']['uncommitted_files']} uncommitted file(s) in guardrails/, "
        f"sources {meta['guardrails']['sources_sha256']}); torch {meta['torch']}; "
        f"--max_iters={meta['steps']} ({meta['steps'] + 1} steps), faults at iter "
        f"{meta['fault_iter']} (guard step {meta['fault_iter'] + 1})",
        "",
        "| scenario | result | time | runs: rc / rank exit codes | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in results["scenarios"].items():
        runs = "<br>".join(
            f"{r['name']}{' (timeout)' if r['timed_out'] else ''}: {r['rc']} / "
            + ", ".join(f"r{k}={v}" for k, v in r["rank_exit_codes"].items())
            for r in s["runs"]
        )
        why = s["reason"].replace("|", "\\|").replace("\n", " ")
        verdict = "PASS" if s["passed"] else "FAIL"
        lines.append(f"| {name} | {verdict} | {s['time_s']:.0f} s | {runs} | {why} |")
    lines += ["", "## Commands and key lines per run", ""]
    for name, s in results["scenarios"].items():
        for r in s["runs"]:
            lines.append(f"**{name} / {r['name']}** (`{r['logs'][1]}`)")
            lines.append("")
            lines.append(f"    cd {r['cwd']} && {r['command']}")
            lines += [f"    {k}" for k in r["key_lines"]] or ["    (no key lines)"]
            lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    p.add_argument("--nanogpt", type=Path, help="a nanoGPT tree (default: the mirror's HEAD)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="results and logs")
    p.add_argument("--work", type=Path, help="trees, data, run dirs (default: a new temp dir)")
    p.add_argument("--steps", type=int, default=60, help="nanoGPT's --max_iters")
    p.add_argument("--fault-iter", type=int, help="nanoGPT iter of the faults (default: half)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--device", default="cpu", help="nanoGPT's --device (1-process scenarios)")
    p.add_argument("--grad-clip", type=float, help="nanoGPT's --grad_clip (0: no clipping)")
    args = p.parse_args()
    OPTS.update(device=args.device, grad_clip=args.grad_clip)
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    args.fault_iter = args.fault_iter if args.fault_iter is not None else args.steps // 2
    if "sigterm_eval" in wanted and args.fault_iter % EVAL_EVERY:
        p.error(f"sigterm_eval needs --fault-iter a multiple of {EVAL_EVERY}")
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="nanogpt-guardrails-"))).resolve()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    print(f"work dir {args.work}; results in {args.out}", flush=True)
    trees, commit = prepare_trees(args.work, args.nanogpt)
    print(f"nanoGPT {commit}", flush=True)
    bench = Bench(args, trees)
    results: dict[str, Any] = {
        "meta": {
            "nanogpt_commit": commit,
            "guardrails": guardrails_version(),
            "torch": torch.__version__,
            "steps": args.steps,
            "fault_iter": args.fault_iter,
            "flags": train_flags(args.steps, 100_000),
            "work_dir": str(args.work),
        },
        "scenarios": {},
    }
    t_all = time.monotonic()
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
    print(f"{time.monotonic() - t_all:.0f} s in all")
    print(f"details: {args.out / 'results.md'}, {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
