#!/usr/bin/env bash
# Issue 18's per-step cost on one GPU, in one call:  bash benchmarks/gpu_overhead.sh OUT [BASE]
# - the GPU tests (sync-freedom with the loop's own clip_grad_norm_ shared, eager and
#   compiled);
# - benchmarks/overhead.py (plain and guarded interleaved in one process) for GPT-2
#   small at 8x1024 (eager, compiled) and 2x1024, without clipping and clipping with
#   torch.nn.utils.clip_grad_norm_, and the `stack` model at 150 and 1,500 tensors;
# - with BASE (a folder holding an older guardrails/ and examples/), the clipping rows
#   and the stack rows again under that version, interleaved run by run.
set -o pipefail
# PART=eager (default: tests, eager and stack rows), PART=compiled (compiled rows), or
# PART=ddp on 2 GPUs (the NCCL tests, then plain DDP vs GuardedDDP under the guard).
OUT=${1:?usage: gpu_overhead.sh OUT [BASE]}
BASE=${2:-}
PART=${PART:-eager}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/machine.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/machine.txt"
[ "$PART" = ddp ] && PYTHONPATH=$PWD:$PWD/tests python3 -m pytest -q -rs -p no:cacheprovider tests/loops/test_gpu.py -k "nccl or ddp_bucket" 2>&1 | tail -15 | tee "$OUT/gpu_tests_ddp.txt"
[ "$PART" = eager ] && PYTHONPATH=$PWD:$PWD/tests python3 -m pytest -q -rs -p no:cacheprovider tests/loops/test_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
run() {  # run TAG PYTHONPATH ARGS...
  local tag=$1 path=$2; shift 2
  echo "== $tag $*" | tee -a "$OUT/overhead.txt"
  PYTHONPATH=$path python3 benchmarks/overhead.py --device cuda --out "$OUT/overhead_$tag.jsonl" "$@" 2>&1 | tail -5 | tee -a "$OUT/overhead.txt"
}
G="--model gpt2 --seq 1024 --steps 20 --warmup 5 --repeats 7"
S="--model stack --steps 50 --warmup 10 --repeats 7"
# DDP: each guarded run starts a fresh guard; its first steps carry one-time start work
# (pinning checkpoint staging memory, a gloo group): 30 warm-up steps keep it out.
D="--model gpt2 --seq 1024 --steps 60 --warmup 30 --repeats 5"
if [ "$PART" = ddp ]; then
for tree in new base; do
  path=$PWD; [ $tree = base ] && path=$BASE
  [ -z "$path" ] && continue
  echo "== $tree ddp 8x1024" | tee -a "$OUT/overhead.txt"
  PYTHONPATH=$path python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/overhead.py --device cuda --ddp $D --batch 8 --out "$OUT/overhead_ddp_$tree.jsonl" 2>&1 \
    | grep -v Warning | tail -5 | tee -a "$OUT/overhead.txt"
done
elif [ "$PART" = eager ]; then
run new "$PWD" $G --batch 8
run new "$PWD" $G --batch 8 --torch-clip
[ -n "$BASE" ] && run base "$BASE" $G --batch 8 --torch-clip
run new "$PWD" $G --batch 2
run new "$PWD" $G --batch 2 --torch-clip
[ -n "$BASE" ] && run base "$BASE" $G --batch 2 --torch-clip
for t in 150 1500; do
  run new "$PWD" $S --tensors $t
  run new "$PWD" $S --tensors $t --torch-clip
  [ -n "$BASE" ] && run base "$BASE" $S --tensors $t --torch-clip
done
else
run new "$PWD" $G --batch 8 --compile
run new "$PWD" $G --batch 8 --compile --torch-clip
[ -n "$BASE" ] && run base "$BASE" $G --batch 8 --compile --torch-clip
fi
echo done | tee -a "$OUT/overhead.txt"
