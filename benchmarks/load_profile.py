"""Where a resume's time goes at 0.835B parameters (10 GB of model and AdamW state) on
a GPU (issue 50: 3.6-4.7 s of a recovery's 60 s): ``guardrails.resume`` of a checkpoint
``guardrails.save_checkpoint`` wrote, under cProfile, with torch's intra-op threads as
torchrun sets them for several workers a node (``OMP_NUM_THREADS=1``).

    python benchmarks/load_profile.py [--dir /tmp/load_profile] [--torch-threads 1]

Prints the save's and the resume's seconds (page cache warm, as after a failure save a
minute before) and the resume's 25 costliest calls by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from train_gpt import GPT  # noqa: E402

import guardrails  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, default=Path("/tmp/load_profile"))
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--width", type=int, default=1536)
    a = p.parse_args()
    torch.set_num_threads(a.torch_threads)
    cuda = torch.cuda.is_available()  # a CPU run only checks this script (tiny sizes)
    dev = torch.device("cuda" if cuda else "cpu")
    with dev:
        model = GPT(50304, 1024, a.layers, a.width // 128, a.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x = torch.randint(0, 50304, (1, 1024), device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        model(x, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if cuda else lambda: None
    sync()
    shutil.rmtree(a.dir, ignore_errors=True)
    t0 = time.perf_counter()
    guardrails.save_checkpoint(a.dir, 1, model=model, optimizer=opt)
    save_s = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    guardrails.resume(a.dir, model, opt)
    sync()
    prof.disable()
    load_s = time.perf_counter() - t0
    print(json.dumps({"save_s": round(save_s, 2), "resume_s": round(load_s, 2)}))
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
