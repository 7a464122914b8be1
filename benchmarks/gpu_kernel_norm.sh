#!/usr/bin/env bash
# The guard's own grad norm by its Triton kernels (issue 18, session 15):
#   PART=tests bash benchmarks/gpu_kernel_norm.sh OUT   # every GPU test, norm_host.py
#   PART=bench bash benchmarks/gpu_kernel_norm.sh OUT   # overhead.py, 1 and 2 GPUs
# - tests: tests/loops/test_gpu.py (the NCCL ones need 2 GPUs), then benchmarks/norm_host.py:
#   host time of one norm, kernel vs eager, 150 and 1,500 tensors, each one's error
#   against a float64 norm;
# - bench: benchmarks/overhead.py, plain / guarded (kernel) / guarded with the eager
#   norm interleaved in one process on GPU 0: GPT-2 small 8x1024 eager and compiled
#   (kernel time) and 2x1024 (process CPU time: the step is host-bound there); then
#   plain DDP vs GuardedDDP under the guard on 2 GPUs (kernel time).
set -o pipefail
OUT=${1:?usage: PART=tests|bench gpu_kernel_norm.sh OUT}
PART=${PART:-tests}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  nproc
} 2>&1 | tee "$OUT/machine_$PART.txt"
if [ "$PART" = tests ]; then
  PYTHONPATH=$PWD:$PWD/tests timeout 420 python3 -m pytest -q -rs -p no:cacheprovider tests/loops/test_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python3 benchmarks/norm_host.py --device cuda --tensors 150 1500 --out "$OUT/norm_host.jsonl" 2>&1 | grep -v nan_guard | tail -4 | tee "$OUT/norm_host.txt"
  exit 0
fi
PYTHONPATH=$PWD:$PWD/tests python3 -m pytest -q -p no:cacheprovider tests/loops/test_gpu.py -k kernel_grad_norm 2>&1 | tail -2 | tee "$OUT/gpu_test_kernel.txt"
run() {  # run ARGS...
  echo "== $*" | tee -a "$OUT/overhead.txt"
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD timeout 200 python3 benchmarks/overhead.py --device cuda --eager-norm --shuffle --out "$OUT/overhead.jsonl" "$@" 2>&1 | grep -v "^ *[-+][0-9.]* us" | tail -8 | tee -a "$OUT/overhead.txt"
}
G="--model gpt2 --seq 1024 --warmup 5"
run $G --batch 8 --steps 20 --repeats 5 --clock kernels
run $G --batch 8 --steps 20 --repeats 5 --clock kernels --compile
run $G --batch 2 --steps 30 --repeats 9 --clock cpu
echo "== ddp 8x1024 kernels" | tee -a "$OUT/overhead.txt"
PYTHONPATH=$PWD timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  benchmarks/overhead.py --device cuda --ddp --model gpt2 --seq 1024 --batch 8 --steps 20 \
  --warmup 30 --repeats 5 --clock kernels --out "$OUT/overhead_ddp.jsonl" 2>&1 \
  | grep -v Warning | tail -16 | tee -a "$OUT/overhead.txt"
