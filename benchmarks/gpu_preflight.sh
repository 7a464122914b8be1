#!/usr/bin/env bash
# Preflight and GuardedDDP on 2 GPUs with NCCL, in one call (~1-2 min on 2x H100):
#   bash benchmarks/gpu_preflight.sh OUT_DIR            # NCCL on cuda:0,1
#   BACKEND=gloo DEVICE=cpu bash benchmarks/gpu_preflight.sh OUT_DIR   # CPU check
# - preflight cost at guard start on a GPT-2-small-shaped model (124M parameters);
# - plain DDP vs GuardedDDP step time (GPT-2 small, bf16 autocast, 8 x 1024 tokens per
#   rank), interleaved in the same run;
# - GuardedDDP under guard(): bucket all-reduces reported to the auditor; two ranks with
#   different seeds and data lengths raising ConfigMismatchError on both;
# - the preflight / DDP / explain tests (gloo, CPU side).
# Writes preflight.json, preflight.md, tests.txt and machine.txt to OUT_DIR.
set -o pipefail
OUT=${1:?usage: gpu_preflight.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
ARGS=(--device "$DEVICE" --out "$OUT")
[ -n "${BACKEND:-}" ] && ARGS+=(--backend "$BACKEND")
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
} 2>&1 | tee "$OUT/machine.txt"
$PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/preflight.py "${ARGS[@]}" \
  2>&1 | grep -v "OMP_NUM_THREADS\|^W.*\*\*\*\*\|^W.*run.py" | tee "$OUT/run.txt"
status=$?
timeout 300 $PY -m pytest -q tests/guards/test_preflight.py tests/guards/test_ddp.py tests/guards/test_explain.py 2>&1 \
  | tail -3 | tee "$OUT/tests.txt"
exit $status
