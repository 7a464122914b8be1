#!/usr/bin/env bash
# The GPU evidence for benchmarks/RESULTS.md, in one call on a GPU machine:
#   bash benchmarks/gpu_run.sh OUT_DIR
# Runs the GPU tests (sync-freedom under set_sync_debug_mode("error"), NanGuard's
# on-device skip) and the overhead benchmark: tiny model (host cost on CUDA), GPT-2
# small at 8x1024 and 2x1024, eager and compiled, against the plain loop and the
# hand-written per-step isfinite(norm).item() check, with and without clipping.
# Uses the repo in place (PYTHONPATH), installs nothing.
set -o pipefail
OUT=${1:?usage: gpu_run.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -q -rs ${GPU_TESTS:-tests/loops/test_gpu.py tests/test_structure.py} 2>&1 | tee "$OUT/gpu_tests.txt"
B="python3 benchmarks/overhead.py --device cuda --out $OUT/bench.jsonl --item"
$B --model tiny --steps 300 --repeats 11 2>&1 | tee -a "$OUT/bench.txt"
$B --model gpt2 --batch 8 --seq 1024 --steps 30 --repeats 7 2>&1 | tee -a "$OUT/bench.txt"
$B --model gpt2 --batch 2 --seq 1024 --steps 100 --repeats 9 2>&1 | tee -a "$OUT/bench.txt"
$B --model gpt2 --batch 8 --seq 1024 --steps 30 --repeats 7 --clip 2>&1 | tee -a "$OUT/bench.txt"
$B --model gpt2 --batch 2 --seq 1024 --steps 100 --repeats 9 --clip 2>&1 | tee -a "$OUT/bench.txt"
$B --model gpt2 --batch 8 --seq 1024 --steps 30 --repeats 7 --compile 2>&1 | tee -a "$OUT/bench.txt"
$B --model gpt2 --batch 2 --seq 1024 --steps 50 --repeats 7 --compile 2>&1 | tee -a "$OUT/bench.txt"
python3 examples/train_gpt.py --steps 300 --sample 0 --run-dir /tmp/gpt_run 2>&1 | tee "$OUT/example.txt"
python3 examples/train_gpt.py --steps 300 --sample 0 --inject bad_sample --run-dir /tmp/gpt_bad 2>&1 | tee -a "$OUT/example.txt"
cp -r /tmp/gpt_bad/nonfinite "$OUT/" 2>/dev/null
python3 benchmarks/components.py --device cuda --repeats 9 2>&1 | tee "$OUT/components.txt"
# Checkpoints (issue 4): SIGTERM-to-exit, periodic-save blocking time, torch.save.
python3 benchmarks/checkpoint_bench.py --device cuda --model example --repeats 3 --out "$OUT" 2>&1 | grep -v stopped | tee -a "$OUT/checkpoint.txt"
python3 benchmarks/checkpoint_bench.py --device cuda --model gpt2 --repeats 3 --out "$OUT" 2>&1 | grep -v stopped | tee -a "$OUT/checkpoint.txt"
# The reference benchmark CLI (issue 8).
python3 -m guardrails bench --size gpt2 --batch 8 --seq 1024 --steps 20 --repeats 5 --json "$OUT/bench_cli_8x1024.json" 2>&1 | tee "$OUT/bench_cli.txt"
