"""Checkpoints at real sizes: SIGTERM -> committed checkpoint -> exit, and the stall of
periodic saves, for a ~0.84B-parameter GPT with fused AdamW (10 GB of state), against the
disk's own floor measured in the same run.

    python benchmarks/checkpoint_big.py --dir /local/disk --out OUT
    python benchmarks/checkpoint_big.py --dir /local/disk --old-guardrails OLD_DIR   # A/B
    python benchmarks/checkpoint_big.py --dir /local/disk --nproc 2 --ddp            # per rank
    python benchmarks/checkpoint_big.py --dir /local/disk --nproc 2 --fsdp
    python benchmarks/checkpoint_big.py --dir /local/disk --every 0 --sigterm-at 10 --repeat 3
        # a pre-emption early in a run without periodic saves: the signal's save is the
        # run's first, staged into memory allocated at start (each run reported)

What it does:

* **Disk floor**: writes as many bytes as the checkpoint holds into one file from one
  thread, then fsyncs (``floor_1x``), and the same with 8 threads writing disjoint
  ranges (``floor_8x``): what the disk does with nothing but the bytes.
* **Training** (a child process, or ``torchrun`` children with ``--nproc``): the model
  trains under ``guardrails.guard`` with ``checkpoint_every_n_steps`` saves; each step is
  timed (a device sync per step, in every variant alike). The parent sends SIGTERM at
  step ``--sigterm-at`` and times the signal to the process's (torchrun's) exit.
* Reported: SIGTERM -> exit, the save's breakdown from its ``checkpoint`` event (stage,
  write + hash, fsync, commit), and for each periodic save the step that took it against
  the median step. With ``--old-guardrails DIR`` the same child runs once more with the
  guardrails package found in DIR (e.g. the previous release), in the same invocation.
  ``--every 0``: no periodic saves (only the signal's); ``--repeat N``: each variant N
  times, every run reported (``--show`` gives each SIGTERM -> exit over the disk floor).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- parent


def run_variant(
    args: argparse.Namespace, name: str, pythonpath: str, work: Path, *, at: int
) -> dict:
    """One run of the child, SIGTERM at step ``at``."""
    run_dir = work / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    child = [
        "--child",
        "--run-dir",
        str(run_dir),
        "--every",
        str(args.every),
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--batch",
        str(args.batch),
    ]
    child += ["--ddp"] if args.ddp else []
    child += ["--fsdp"] if args.fsdp else []
    child += ["--sample", "--sample-over-s", str(args.sample_over_s)] if args.sample else []
    child += (
        ["--spy", args.spy, "--spy-out", str(Path(args.out or work).resolve())] if args.spy else []
    )
    if args.switch_interval_s:
        child += ["--switch-interval-s", str(args.switch_interval_s)]
    child += ["--noise", args.noise] if args.noise else []
    child += ["--foreach"] if args.foreach else []
    child += ["--patch", args.patch] if args.patch else []
    if args.nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(args.nproc),
            __file__,
            *child,
        ]
    else:
        cmd = [sys.executable, __file__, *child]
    env = {**os.environ, "PYTHONPATH": f"{pythonpath}:{ROOT / 'examples'}"}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    steps: dict[int, float] = {}
    log: list[str] = []
    t_signal = None
    wall_signal = math.nan
    at_exit: dict[int, float] = {}
    ran = None
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)
        if line.startswith("STEP ") and len(line.split()) == 3:  # not a line two ranks interleaved
            _, step, ms = line.split()
            steps[int(step)] = float(ms)
            if int(step) == at and t_signal is None:
                t_signal = time.perf_counter()
                wall_signal = time.time()
                proc.send_signal(signal.SIGTERM)
        elif line.startswith("GUARDRAILS "):
            ran = line.split(maxsplit=1)[1].strip()
        elif line.startswith(("SAMPLE ", "DEQUE ", "NOISE ")) or args.echo:
            print(line, end="", flush=True)  # --sample: where a long step's time went
        elif line.startswith("ATEXIT "):  # a rank's interpreter reached its atexit hooks
            _, rank, when = line.split()
            at_exit[int(rank)] = float(when)
    code = proc.wait()
    t_exit = time.perf_counter()
    wall_exit = time.time()
    from guardrails.metrics.events import read_events

    events = read_events(run_dir)
    saves = [e for e in events if e["kind"] == "checkpoint"]
    for e in saves:  # each save's own figures, periodic ones too
        print(
            f"  save step {e['step']} rank {e['rank']}: {e.get('seconds')} s (stage "
            f"{e.get('stage_s')}, write {e.get('write_s')}, fsync {e.get('fsync_s')}), "
            f"{e.get('dcp_staging', '')}",
            flush=True,
        )
    for e in events:
        if e["kind"] in ("checkpoint_abandoned", "checkpoint_failed"):
            said = f"  {e['kind']} rank {e['rank']} step {e['step']}: {e.get('message')}"
            print(said, flush=True)
    skipped = [e["step"] for e in events if e["kind"] == "checkpoint_skipped"]
    median = statistics.median(steps.values()) if steps else float("nan")
    # The boundary after step s (where a save of step s is staged, or skipped) is timed
    # in step s+1: every due save, committed, skipped or later abandoned.
    due = range(args.every, at, args.every) if args.every else range(0)
    stalls = {s: steps[s + 1] - median for s in due if s + 1 in steps}
    # The steps after each due save (or --noise), over the median: a stall can be one
    # long step or many slower ones while the write goes on.
    after = {s: [round(steps[k] - median) for k in range(s + 1, s + 26) if k in steps] for s in due}
    last = [e for e in saves if e["step"] >= at]
    # Where the time from SIGTERM to the launcher's exit goes, per rank (seconds after
    # the signal): the signal save committed (its event), the guard closed (its end
    # event), the interpreter reached atexit (after the with-block and SystemExit), and
    # the launcher (torchrun) exited.
    ends = {e["rank"]: e["time"] for e in events if e["kind"] == "end"}
    dropped = {e["rank"]: e["time"] for e in events if e["kind"] == "checkpoint_abandoned"}
    timeline = {
        rank: {
            # an older save still being written, abandoned by the stop (its event)
            "abandoned": dropped[rank] - wall_signal if rank in dropped else None,
            # the signal's save began (its event's time less its seconds): the step in
            # flight and the boundary came first
            "save_began": next(
                (e["time"] - e["seconds"] - wall_signal for e in last if e["rank"] == rank),
                None,
            ),
            "saved": next((e["time"] - wall_signal for e in last if e["rank"] == rank), None),
            "guard_closed": ends[rank] - wall_signal if rank in ends else None,
            "atexit": at_exit[rank] - wall_signal if rank in at_exit else None,
        }
        for rank in range(args.nproc)
    }
    timeline["launcher_exit"] = wall_exit - wall_signal
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    size = sum(f.stat().st_size for f in ckpts[-1].rglob("*") if f.is_file()) if ckpts else 0
    expected = Path(pythonpath).resolve() / "guardrails"
    if ran is not None and Path(ran) != expected:
        raise SystemExit(f"the {name} run imported guardrails from {ran}, not {expected}")
    return {
        "variant": name,
        "sigterm_at": at,
        "guardrails": ran,
        "exit_code": code,
        "sigterm_to_exit_s": None if t_signal is None else t_exit - t_signal,
        "median_step_ms": median,
        # Steps 1-10 over the median: the staging memory is allocated ahead, in a
        # thread, after step 1 (pinning it can hold up the training thread's launches).
        "first_steps_ms": {k: round(steps[k] - median) for k in range(1, 11) if k in steps},
        "periodic_stall_ms": stalls,
        "after_ms": after,
        "skipped": skipped,
        "signal_saves": last,
        "exit_timeline_s": timeline,
        "bytes_per_save": size,
        # Kept when something went wrong: a crash, or a stop that saved nothing.
        "log_tail": "".join([x for x in log if not x.startswith("STEP ")][-80:])
        if (code not in (143, -15) and t_signal is None) or not last
        else "",
    }


def parent(args: argparse.Namespace) -> None:
    import torch

    # Imported here, never in a child: a child must import the guardrails its
    # PYTHONPATH names (--old-guardrails). With this import at the top of the file,
    # every child ran this checkout's guardrails, the "old" variant included (the A/Bs
    # of sessions 9-13 until this was found; benchmarks/RESULTS.md says which).
    sys.path.insert(0, str(ROOT))
    from guardrails.cli.bench_checkpoint import disk_floor

    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="ckbig-", dir=base))
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": args.nproc,
        "torch": torch.__version__,
        "dir": str(base),
        "mode": "fsdp2" if args.fsdp else ("ddp" if args.ddp else "single"),
        "every": args.every or None,
        "sigterm_at": args.sigterm_at,
    }
    try:
        variants = [("new", str(ROOT))]
        if args.old_guardrails:
            variants.insert(0, ("old", str(Path(args.old_guardrails).resolve())))
        # Every SIGTERM step of --sigterm-at (2,5,10,45), each variant in turn, against
        # one disk floor measured after them.
        runs = [
            run_variant(args, name if args.repeat == 1 else f"{name}#{i + 1}", path, work, at=at)
            for at in args.sigterm_at
            for i in range(args.repeat)
            for name, path in variants
        ]
        nbytes = max(r["bytes_per_save"] for r in runs) or 10 << 30
        if args.floor:  # --no-floor: a control run (--patch, --spy) that times no save
            results["floor_1x"] = disk_floor(work, nbytes, 1)  # the same code as
            results["floor_8x"] = disk_floor(work, nbytes, 8)  # `guardrails bench --checkpoint`
        results["runs"] = runs
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "checkpoint_big.jsonl", "a") as f:
            f.write(json.dumps(results, default=str) + "\n")


def show(path: str) -> None:
    """One paragraph per result line of a checkpoint_big.jsonl."""
    for line in Path(path).read_text().splitlines():
        d = json.loads(line)
        if "floor_1x" in d:
            f1, f8 = d["floor_1x"], d["floor_8x"]
            floor = (
                f"disk floor {f1['total_s']:.2f} s (1 thread, {f1['GBps']:.2f} GB/s, "
                f"fsync {f1['fsync_s']:.2f} s), {f8['total_s']:.2f} s (8 threads)"
            )
        else:
            floor = "disk floor not measured (--no-floor)"
        print(f"{d['mode']} on {d['gpus']} x {d['device']}, torch {d['torch']}: {floor}")
        if "every" in d:
            print(f"  periodic saves every {d['every']} steps, SIGTERM at step {d['sigterm_at']}")
        for r in d["runs"]:
            stalls = {k: round(v) for k, v in r["periodic_stall_ms"].items()}
            to_exit = r["sigterm_to_exit_s"] or -1
            ratio = (
                f" ({to_exit / d['floor_1x']['total_s']:.2f}x the floor)" if "floor_1x" in d else ""
            )
            print(
                f"  {r['variant']} (SIGTERM at {r.get('sigterm_at', d['sigterm_at'])}): "
                f"exit {r['exit_code']}, SIGTERM -> exit "
                f"{to_exit:.2f} s{ratio}, median step {r['median_step_ms']:.1f} ms, "
                f"stall of each periodic save (ms over the median) {stalls}, "
                f"skipped {r['skipped']}, {r['bytes_per_save'] / 1e9:.2f} GB per save"
            )
            if "first_steps_ms" in r:
                print(f"    steps 1-10 over the median (ms): {r['first_steps_ms']}")
            for e in r["signal_saves"]:
                keys = ("bytes", "seconds", "stage_s", "stage_fresh_bytes", "write_s", "fsync_s")
                keys += ("commit_s", "sharded")
                keys += ("dcp_staging",)
                print(f"    rank {e['rank']} step {e['step']}: { ({k: e.get(k) for k in keys}) }")
            for s, after in (r.get("after_ms") or {}).items():
                print(f"    steps after step {s} (ms over the median): {after}")
            if r.get("exit_timeline_s"):
                print(f"    after SIGTERM (s): {r['exit_timeline_s']}")
            if r["log_tail"]:
                print(r["log_tail"][-800:])


# ------------------------------------------------------------------------------ child


class Sampler:
    """``--sample``: where a long step's wall time went on this rank. A thread takes the
    main thread's stack every 10 ms (it needs the GIL to do so: fewer samples than the
    step's 10 ms ticks mean the main thread held it, or another thread did), and each
    thread's CPU seconds over the step are read from /proc (which thread burned the
    host: DCP's writers, guardrails' own, the training thread)."""

    def __init__(self) -> None:
        import collections
        import threading

        self.main = threading.get_ident()
        self.samples: collections.deque = collections.deque(maxlen=100_000)
        self.lock = threading.Lock()  # report() reads while _run() appends
        self.tick = os.sysconf("SC_CLK_TCK")
        threading.Thread(target=self._run, name="bench-sampler", daemon=True).start()

    def _run(self) -> None:
        import threading

        while True:
            time.sleep(0.01)
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "native")  # autograd's device threads are native
                if name == "bench-sampler":
                    continue
                if name.startswith("Thread-") and "(" in name:  # DCP's writers, numbered
                    name = name.split(" ", 1)[1]
                if frame.f_code.co_filename.endswith(("threading.py", "queue.py", "selectors.py")):
                    continue  # an idle thread waiting for work
                stack = []
                while frame is not None and len(stack) < 4:
                    code = frame.f_code
                    stack.append(f"{Path(code.co_filename).name}:{frame.f_lineno}({code.co_name})")
                    frame = frame.f_back
                with self.lock:
                    self.samples.append((now, name, " < ".join(stack)))

    def cpu(self) -> dict[str, float]:
        import threading

        out: dict[str, float] = {}
        for t in threading.enumerate():
            try:
                fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1]
                utime, stime = fields.split()[11:13]
            except (OSError, IndexError, ValueError):
                continue
            name = t.name.split("_")[0] if t.name.startswith("ThreadPoolExecutor") else t.name
            out[name] = out.get(name, 0.0) + (int(utime) + int(stime)) / self.tick
        return out

    def report(self, rank: int, step: int, t0: float, t1: float, cpu0: dict) -> None:
        import collections

        with self.lock:
            window = [x for x in self.samples if t0 <= x[0] <= t1]
        got = [(name, stack) for _, name, stack in window]
        ticks = len({t for t, _, _ in window})
        cpu1 = self.cpu()
        burn = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items()}
        burn = {k: v for k, v in sorted(burn.items(), key=lambda kv: -kv[1]) if v > 0}
        print(
            f"SAMPLE rank {rank} step {step}: {t1 - t0:.2f} s, {ticks} samples "
            f"(of {int((t1 - t0) * 100)} ticks); CPU s by thread {burn}",
            flush=True,
        )
        for (name, stack), n in collections.Counter(got).most_common(14):
            print(f"SAMPLE rank {rank}   {n:5d}  [{name}] {stack}", flush=True)


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from train_gpt import GPT

    import guardrails

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:  # the parent records which guardrails ran
        print(f"GUARDRAILS {Path(guardrails.__file__).resolve().parent}", flush=True)
    if args.switch_interval_s:
        sys.setswitchinterval(args.switch_interval_s)
    if args.patch:
        _patch(args.patch)
    cuda = torch.cuda.is_available()  # a CPU run only checks this script (tiny sizes)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(50304, 1024, args.layers, args.width // 128, args.width).to(device)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif args.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if cuda else None)
    # FSDP2's DTensors get torch's single-tensor AdamW unless foreach is asked for (as
    # torchtitan does): thousands of small launches per step, each a GIL hand-off.
    foreach = True if args.foreach else None
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=cuda and not args.fsdp, foreach=foreach
    )
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"params {n / 1e9:.3f}B", flush=True)  # a DTensor's numel is its global one
    data = [(torch.randint(0, 50304, (args.batch, 1024), device=device),) * 2 for _ in range(4)]
    # The moment this rank's interpreter starts shutting down (after the guard's
    # SystemExit(143) left the with-block): the parent splits the exit time with it.
    atexit.register(lambda: print(f"ATEXIT {rank} {time.time():.6f}", flush=True))
    with guardrails.guard(
        model,
        opt,
        data * 10_000,
        run_dir=args.run_dir,
        progress=False,
        checkpoint={
            "every_n_steps": 10**9 if args.noise else (args.every or None),
            "keep_last": 1,
        },
    ) as g:
        sampler = Sampler() if args.sample else None
        cpu0 = sampler.cpu() if sampler else {}
        t = time.perf_counter()
        for x, y in g:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if rank == 0:
                print(f"STEP {g.step} {(now - t) * 1e3:.2f}", flush=True)
            if args.spy and g.step == args.every - 1:  # the next boundary starts a save
                _spy(args.spy, rank, Path(args.spy_out))
            if args.noise and g.step == args.every:
                _noise(args.noise, Path(args.run_dir), rank, model, opt)
                now = time.perf_counter()  # the next step is timed from here
            if sampler is not None:
                if now - t > args.sample_over_s and g.step > 5:
                    sampler.report(rank, g.step, t, now, cpu0)
                cpu0 = sampler.cpu()
            t = now


def _patch(kind: str) -> None:
    """``--patch``: a control that takes one part out of the guard's FSDP2 saves, to
    tell which part the step that starts a save waits for. Only that step's stall is
    measured: with ``nodisk`` and ``nowrite`` the first save then fails, and as a
    run_dir that takes no checkpoint at all, ends the run a few steps later. ``nohash``:
    nothing is hashed (sha256 replaced by a no-op); ``nodisk``: the shard files are
    written to /dev/null (serialized and hashed, never sent to disk); ``nowrite``: the
    shards are staged and the plan exchanged, then no item is written (the writer
    sleeps 5 s)."""
    from guardrails.checkpoint import digest as _digest
    from guardrails.checkpoint import sharded

    if kind == "nohash":

        class Nothing:
            def update(self, data) -> None:
                pass

            def digest(self) -> bytes:
                return bytes(32)

            def hexdigest(self) -> str:
                return "0" * 64

        # Only _digest's name for the module: hashlib itself is untouched.
        _digest.hashlib = type("hashlib", (), {"sha256": staticmethod(lambda *a: Nothing())})
    elif kind == "nodisk":
        init = _digest.HashingFile.__init__

        def to_null(self, path, *args, **kwargs) -> None:
            init(self, Path(os.devnull), *args, **kwargs)

        _digest.HashingFile.__init__ = to_null
        # /dev/null refuses sync_file_range and fsync (EINVAL): nothing to send there.
        import errno
        import types

        def fsync(fd: int) -> None:
            try:
                os.fsync(fd)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise

        _digest.send_to_disk = lambda *args, **kwargs: None
        _digest.os = types.SimpleNamespace(**{**vars(os), "fsync": fsync})
    elif kind == "nowrite":

        def sleep_instead(target, rank, planner, items, cancel):
            time.sleep(5)
            raise OSError("--patch nowrite: no item written")

        sharded._write_items = sleep_instead


def _spy(kind: str, rank: int, out: Path) -> None:
    """``--spy``: py-spy (on PATH, or SPY=/path/to/py-spy) records this rank for 3 s
    from the step before the first save: ``native`` every thread's Python and native
    stack (is the training thread waiting for the GIL, a CUDA call, NCCL?), ``gil`` only
    the thread holding the GIL in each sample (who holds it while training waits). The
    stacks are py-spy's raw format (one line per stack and thread, with its count)."""
    import ctypes
    import shutil as sh

    # Yama's ptrace_scope 1 lets a process be traced only by its ancestors: allow any.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER
    spy = os.environ.get("SPY") or sh.which("py-spy")
    if spy is None:
        print("NOISE --spy: no py-spy found", flush=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    cmd = [spy, "record", "--pid", str(os.getpid()), "--rate", "200", "--duration", "3"]
    cmd += ["--threads", "--format", "raw", "-o", str(out / f"spy_{kind}_rank{rank}.txt")]
    cmd += ["--native", "--idle"] if kind == "native" else ["--gil"]
    with open(out / f"spy_{kind}_rank{rank}.err", "w") as err:
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)  # runs on: it has the fd
    time.sleep(0.3)  # let it attach before the boundary


def _noise(kind: str, run_dir: Path, rank: int, model, opt) -> None:
    """``--noise``: instead of a save, write as many bytes as this rank's save would
    (parameters and AdamW's two moments, fp32) by other means, to tell the disk and
    the kernel's writeback (``dd``: another process) from this process's threads
    (``threads``: 8 Python threads, the GIL released in each write) and from the GIL
    alone (``gil``: one thread running Python for 5 s, no I/O); ``torchsave``: 8 threads
    writing with ``torch.save`` as DCP's writers do, without DCP's planning around it;
    ``items-save`` / ``items-raw``: this rank's own shards (parameters and both moments,
    item by item as DCP writes them), staged in pinned memory first, written by 8
    threads with ``torch.save`` or as raw bytes (one ``write`` per item)."""
    import subprocess
    import threading

    import torch

    local = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    nbytes = local * 4 * 3
    chunk = 64 << 20
    print(f"NOISE rank {rank}: {kind}, {nbytes / 1e9:.2f} GB", flush=True)
    if kind == "dd":
        subprocess.Popen(
            [
                "dd",
                "if=/dev/zero",
                f"of={run_dir}/noise-{rank}.bin",
                f"bs={chunk}",
                f"count={max(nbytes // chunk, 1)}",
                "conv=fsync",
                "status=none",
            ]
        )
    elif kind == "threads":
        buf = bytes(chunk)

        def write(i: int) -> None:
            with open(run_dir / f"noise-{rank}-{i}.bin", "wb") as f:
                for _ in range(max(nbytes // chunk // 8, 1)):
                    f.write(buf)
                f.flush()
                os.fsync(f.fileno())

        for i in range(8):
            threading.Thread(target=write, args=(i,), daemon=True).start()
    elif kind == "torchsave":  # DCP's own per-item write, without DCP around it

        def save(i: int) -> None:
            t = torch.empty(chunk // 4, pin_memory=torch.cuda.is_available())
            with open(run_dir / f"noise-{rank}-{i}.bin", "wb") as f:
                for _ in range(max(nbytes // chunk // 8, 1)):
                    torch.save(t, f)
                f.flush()
                os.fsync(f.fileno())

        for i in range(8):
            threading.Thread(target=save, args=(i,), daemon=True).start()
    elif kind.startswith("items-"):
        local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        for p in model.parameters():
            local += [getattr(t, "_local_tensor", t) for t in opt.state[p].values() if t.dim()]
        pin = torch.cuda.is_available()
        staged = [torch.empty_like(t, device="cpu", pin_memory=pin).copy_(t) for t in local]
        print(f"NOISE rank {rank}: {kind}, {len(staged)} items", flush=True)

        def items(i: int) -> None:
            with open(run_dir / f"noise-{rank}-{i}.bin", "wb") as f:
                for t in staged[i::8]:
                    if kind == "items-save":
                        torch.save(t, f)
                    else:
                        f.write(memoryview(t.view(torch.uint8).numpy()))
                f.flush()
                os.fsync(f.fileno())

        for i in range(8):
            threading.Thread(target=items, args=(i,), daemon=True).start()
    elif kind == "gil":

        def spin() -> None:
            end, x = time.perf_counter() + 5.0, 0
            while time.perf_counter() < end:
                x += 1

        threading.Thread(target=spin, daemon=True).start()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--show", metavar="JSONL", help="print the results in a checkpoint_big.jsonl")
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--dir", help="the disk to save on (default: the temp dir)")
    p.add_argument("--out", help="append the results to OUT/checkpoint_big.jsonl")
    p.add_argument("--old-guardrails", help="a directory holding another guardrails package")
    p.add_argument(
        "--every", type=int, default=20, help="checkpoint_every_n_steps (0: no periodic saves)"
    )
    p.add_argument("--repeat", type=int, default=1, help="run each variant this many times")
    p.add_argument(
        "--sigterm-at",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[75],
        help="the step(s) to send SIGTERM at, comma-separated: one run each (2,5,10,45)",
    )
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument(
        "--switch-interval-s", type=float, help="sys.setswitchinterval in the training ranks"
    )
    p.add_argument(
        "--noise",
        choices=("dd", "threads", "torchsave", "gil", "items-save", "items-raw"),
        help="no periodic saves: at step --every write the same bytes by other means",
    )
    p.add_argument(
        "--patch",
        choices=("nohash", "nodisk", "nowrite"),
        help="a control: take one part out of the guard's saves (see _patch; saves then fail)",
    )
    p.add_argument("--echo", action="store_true", help="print the children's output")
    p.add_argument(
        "--sample-over-s", type=float, default=1.0, help="--sample: the steps over this long"
    )
    p.add_argument(
        "--spy",
        choices=("native", "gil"),
        help="py-spy records each rank for 3 s from the first save's boundary, into "
        "OUT/spy_* (give --out: the work dir is deleted; see _spy)",
    )
    p.add_argument("--spy-out", help=argparse.SUPPRESS)
    p.add_argument(
        "--no-floor", dest="floor", action="store_false", help="skip the disk floor (controls)"
    )
    p.add_argument("--foreach", action="store_true", help="AdamW(foreach=True) (FSDP2)")
    p.add_argument(
        "--sample",
        action="store_true",
        help="print where each step over 1 s spent its time (stacks, CPU per thread)",
    )
    args = p.parse_args()
    if args.show:
        show(args.show)
    else:
        (child if args.child else parent)(args)


if __name__ == "__main__":
    main()
