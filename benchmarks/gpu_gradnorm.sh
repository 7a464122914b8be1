#!/usr/bin/env bash
# GPU evidence for the grad norm's CUDA graph (graph_grad_norm, issue 8's host cost):
#   bash benchmarks/gpu_gradnorm.sh OUT_DIR
# The graph tests first (replay equals eager, no sync, moved gradients never read),
# then benchmarks/grad_norm.py (host and device cost of one norm, GPT-2 small) and
# overhead.py at 2x1024, 8x1024 and the tiny model with three variants interleaved:
# plain, guarded (defaults), guarded with graph_grad_norm=True; then the other GPU tests.
set -o pipefail
OUT=${1:?usage: gpu_gradnorm.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/machine.txt" 2>&1
T="python3 -m pytest -q -rs tests/loops/test_gpu.py"
$T -k "graph or never_syncs" 2>&1 | tail -25 > "$OUT/tests_graph.txt"
python3 benchmarks/grad_norm.py --model gpt2 --out "$OUT/bench.jsonl" > "$OUT/bench.txt" 2>&1
B="python3 benchmarks/overhead.py --device cuda --graph-norm --out $OUT/bench.jsonl"
$B --model gpt2 --batch 2 --seq 1024 --steps 60 --repeats 7 >> "$OUT/bench.txt" 2>&1
$B --model gpt2 --batch 8 --seq 1024 --steps 20 --repeats 5 >> "$OUT/bench.txt" 2>&1
$B --model tiny --steps 300 --repeats 7 >> "$OUT/bench.txt" 2>&1
$T tests/test_structure.py -k "not graph and not never_syncs" 2>&1 | tail -15 > "$OUT/tests_rest.txt"
