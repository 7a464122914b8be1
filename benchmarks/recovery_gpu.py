"""From a fault to training again at 0.835B parameters: a hang, the watchdog's verdict,
the processes' exit, the same command again (a requeue), ``resume="auto"`` from the
last periodic checkpoint, the first step; with the time of each part.

    python benchmarks/recovery_gpu.py --out OUT            # 2 ranks, gloo
    python benchmarks/recovery_gpu.py --ddp --fault kill   # DDP over NCCL, 2 GPUs

The watchdog works across ranks (in a single process it only publishes the live view):
the job is 2 ranks under ``torchrun --standalone``, each on its own GPU where the machine
has two (``cuda:LOCAL_RANK``), both on GPU 0 where it has one, with
a gloo group for guardrails' own traffic and no gradient all-reduce (each rank trains
its own copy of ``examples/train_gpt.py``'s GPT, 27 x 1536, fused AdamW, bf16, 4 x 1024
tokens; the preflight, which refuses two ranks on one GPU, is off). Rank 0 saves the
model and optimizer (10 GB) every ``--every`` steps in the background. On the first
attempt rank 1 sleeps in the loop at step ``--hang-at`` (``watchdog={"hang_timeout_s":
--timeout-s}``); both ranks end with ``HangError``; the parent runs the same command
again at once and lets it train ``--steps-after`` steps. ``--ddp``: the user's shape
instead, DDP over NCCL with a GPU per rank (the gradients all-reduced, the model and
optimizer replicated: rank 0 writes them, every rank its RNG streams and data
position). ``--fault kill``: rank 1 SIGKILLs itself there instead of sleeping.
``--build-on-gpu``: the model initialised on its GPU (``with torch.device(...)``), as
scripts of this size do, instead of on the CPU then moved (12-20 s of the restart with
torchrun's one thread a worker: the script's own time, the same without guardrails).
``--local-dir DIR``: saves go first to a node-local tier there (``/dev/shm/...``). Two
ranks sharing one GPU take about twice a lone rank's step, and build their models one
after the other.

Reported (seconds): detection (the fault to the hang event), exit (the event to
torchrun's end), restart (torchrun's start to CUDA ready in the ranks: Python, torch's
import, CUDA's init), build (the model and optimizer), resume (``guard()`` entered to
returned: the checkpoint found, checked, loaded), first step, and the total from the
fault to the first step trained again; the steps redone (the hang's step less the
resumed one).
"""

from __future__ import annotations

import time

T0 = time.time()  # before any import: the process's start, near enough

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def child(a: argparse.Namespace) -> None:
    rank = int(os.environ.get("RANK", "0"))

    def mark(what: str, **fields) -> None:
        line = "MARK " + json.dumps({"rank": rank, "what": what, "t": time.time(), **fields})
        os.write(1, (line + "\n").encode())  # one write: two ranks share the pipe

    mark("start", t0=T0)
    import logging

    # guardrails' warnings with their time (a last word given up, a teardown that did not
    # end), and the debug line just before the process ends: the exit's parts.
    logging.basicConfig(format="%(created).3f %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("guardrails.record").setLevel(logging.DEBUG)
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import GPT

    import guardrails

    mark("imported")
    cuda = torch.cuda.is_available()  # a CPU run only checks this script (tiny sizes)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        torch.ones(1, device=dev).sum().item()
    if a.ddp and cuda:
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")
    mark("cuda")
    torch.manual_seed(0)
    if a.build_on_gpu:  # as scripts of this size do (nanochat, torchtitan): no CPU init
        with dev:
            model = GPT(50304, 1024, a.layers, a.width // 128, a.width)
    else:  # initialised on the CPU (one thread a worker under torchrun), then moved
        model = GPT(50304, 1024, a.layers, a.width // 128, a.width).to(dev)
    if a.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    data = [(torch.randint(0, 50304, (a.batch, 1024), device=dev),) * 2 for _ in range(4)]
    if cuda:
        torch.cuda.synchronize()
    mark("built")
    with guardrails.guard(
        model,
        opt,
        data * 10_000,
        run_dir=a.run_dir,
        progress=False,
        preflight=False,
        checkpoint={
            "every_n_steps": a.every,
            "keep_last": 1,
            "failure_save_timeout_s": a.save_timeout_s,
            **({"local_directory": a.local_dir} if a.local_dir else {}),
        },
        watchdog={"hang_timeout_s": a.timeout_s},
    ) as g:
        mark("resumed", step=g.step)
        if a.stacks_after_s:  # where each thread waits, once a step takes that long
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from gpu_stuck_copy import watch

            stacks = open(a.run_dir / f"stacks_rank{rank}.txt", "w")  # noqa: SIM115
            watch(a.stacks_after_s, lambda: g.step, stacks)
        first = g.step
        for x, y in g:
            # Stuck at the top of the step after step --hang-at (a loader, a lock, a
            # collective the other rank never joins): the weights are still those of
            # the last finished step, which the failure save keeps. A hang after
            # optimizer.step() and before the next batch saves nothing yet.
            if a.hang_at and g.step == a.hang_at and rank == 1:
                mark("fault", step=g.step)
                if a.fault == "kill":
                    os.kill(os.getpid(), 9)
                time.sleep(3600)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if g.step == first + 1:
                if cuda:
                    torch.cuda.synchronize()
                mark("first_step", step=g.step)
            if not a.hang_at and g.step >= first + a.steps_after:
                break


def attempt(a: argparse.Namespace, *, hang: bool) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", "2", __file__, "--child", "--run-dir", str(a.run_dir)]
    cmd += ["--every", str(a.every), "--timeout-s", str(a.timeout_s)]
    cmd += ["--layers", str(a.layers), "--width", str(a.width), "--batch", str(a.batch)]
    cmd += ["--steps-after", str(a.steps_after)]
    cmd += ["--hang-at", str(a.hang_at if hang else 0), "--fault", a.fault]
    cmd += ["--ddp"] if a.ddp else []
    cmd += ["--build-on-gpu"] if a.build_on_gpu else []
    cmd += ["--local-dir", a.local_dir] if a.local_dir else []
    cmd += ["--save-timeout-s", str(a.save_timeout_s)]
    cmd += ["--stacks-after-s", str(a.stacks_after_s)] if hang else []
    launched = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: dict[str, dict] = {}
    tail: list[str] = []
    lines: list[tuple[float, str]] = []  # when each line came: the exit's parts
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("MARK ") and line.endswith("}\n"):
            m = json.loads(line[5:])
            marks.setdefault(m["what"], {})[m["rank"]] = m
        else:
            tail = [*tail, line][-30:]
            lines = [*lines, (time.time(), line.rstrip()[:300])][-200:]
    code = proc.wait()
    return {
        "launched": launched,
        "ended": time.time(),
        "code": code,
        "marks": marks,
        "tail": tail,
        "lines": lines,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/recovery_gpu"))
    p.add_argument("--out", type=Path)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--hang-at", type=int, default=70)
    p.add_argument("--timeout-s", type=float, default=20.0)
    p.add_argument("--steps-after", type=int, default=5)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ddp", action="store_true", help="DDP over NCCL, a GPU per rank")
    p.add_argument("--build-on-gpu", action="store_true", help="initialise the model on the GPU")
    p.add_argument("--fault", choices=("hang", "kill"), default="hang")
    p.add_argument("--local-dir", help="checkpoint local_directory (node-local tier)")
    p.add_argument("--save-timeout-s", type=float, default=20.0, help="failure_save_timeout_s")
    p.add_argument(
        "--stacks-after-s", type=float, default=0.0, help="dump every thread's stack then"
    )
    a = p.parse_args()
    if a.child:
        child(a)
        return
    import torch

    shutil.rmtree(a.run_dir, ignore_errors=True)
    if a.local_dir:
        shutil.rmtree(a.local_dir, ignore_errors=True)
    first = attempt(a, hang=True)
    second = attempt(a, hang=False)
    from guardrails.metrics.events import read_events

    events = read_events(a.run_dir)
    hangs = [e for e in events if e["kind"] in ("hang", "rank_failed")]
    fault = first["marks"].get("fault", {}).get(1, {}).get("t")
    seen = min((e["time"] for e in hangs), default=None)
    m2 = second["marks"]

    def at(what: str, marks: dict = m2) -> float | None:
        got = [m["t"] for m in marks.get(what, {}).values()]
        return max(got) if got else None  # the later rank: the job waits for it

    def span(begin: float | None, end: float | None) -> float | None:
        return None if begin is None or end is None else end - begin

    starts = [m.get("t0") for m in m2.get("start", {}).values() if m.get("t0")]
    parts = {
        "detection_s": span(fault, seen),
        "exit_s": span(seen, first["ended"]),
        "restart_s": span(second["launched"], at("cuda")),
        "build_s": span(at("cuda"), at("built")),
        "resume_s": span(at("built"), at("resumed")),
        "first_step_s": span(at("resumed"), at("first_step")),
        "fault_to_training_s": span(fault, at("first_step")),
        # The restart's parts: torchrun to the workers' start, their imports (torch,
        # the script's, guardrails), CUDA and the process group.
        "restart_launch_s": span(second["launched"], max(starts) if starts else None),
        "restart_import_s": span(max(starts) if starts else None, at("imported")),
        "restart_cuda_s": span(at("imported"), at("cuda")),
        # The first attempt's first step, from a fresh start: what a first step costs
        # without a resume (CUDA's lazy loading, NCCL's first connections).
        "fresh_first_step_s": span(at("resumed", first["marks"]), at("first_step", first["marks"])),
    }
    resumed = [m["step"] for m in m2.get("resumed", {}).values()]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": min(2, torch.cuda.device_count()),
        "torch": torch.__version__,
        "exit_codes": [first["code"], second["code"]],
        "fault": a.fault,
        "ddp": a.ddp,
        "build_on_gpu": a.build_on_gpu,
        "local_dir": a.local_dir,
        "save_timeout_s": a.save_timeout_s,
        "hang_at": a.hang_at,
        "resumed_at": resumed,
        "steps_redone": a.hang_at - min(resumed) if resumed else None,
        "requeue_gap_s": second["launched"] - first["ended"],
        **{k: None if v is None else round(v, 2) for k, v in parts.items()},
    }
    print(json.dumps(result, indent=1))
    if seen is not None:  # what the first attempt printed from the verdict to its end
        told = [f"{t - seen:+7.2f} {line}" for t, line in first["lines"] if t >= seen - 1]
        told.append(f"{first['ended'] - seen:+7.2f} (torchrun ended)")
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / f"exit_lines_{a.fault}.txt").write_text("\n".join(told) + "\n")
        else:
            print("--- first attempt's output after the verdict (s after it):")
            print("\n".join(told))
    for name, att in (("first", first), ("second", second)):
        ok = (0,) if name == "second" else (1, 83)  # torchrun: 1 when a rank failed
        if att["code"] not in ok or (name == "second" and not resumed):
            print(f"--- {name} attempt's output tail:\n" + "".join(att["tail"]))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        with open(a.out / "recovery_gpu.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
