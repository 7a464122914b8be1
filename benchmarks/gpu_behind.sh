#!/usr/bin/env bash
# A failure save when the GPU is a step behind its stuck host (issue 50), in device calls:
#   bash benchmarks/gpu_behind.sh OUT tests [EXPR]  # GPU tests (-k EXPR); without: + marks' cost
#   [LOCAL="--local-dir /dev/shm/r"] [EXTRA="--save-timeout-s 60"] bash benchmarks/gpu_behind.sh OUT recovery kill,hang
#   (DDP over NCCL, 2 GPUs)
#   bash benchmarks/gpu_behind.sh OUT stuck   # a thread's copy behind a stuck all-reduce
OUT=${1:?usage: gpu_behind.sh OUT tests|recovery}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc
} 2>&1 | tee "$OUT/machine.txt"
case "$2" in
tests)
  timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/loops/test_gpu.py \
    -k "${3:-behind or failure_saves_copy or never_syncs or checkpoints_on_cuda or live_view}" \
    2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
  [ -z "$3" ] && timeout 150 python3 benchmarks/update_marks.py 2>&1 | tail -5 \
    | tee "$OUT/update_marks.txt"
  ;;
stuck)
  run() {  # how gb name env queue
    env $4 timeout 100 python3 benchmarks/gpu_stuck_copy.py --how $1 --gb $2 --limit-s 20 \
      --queue $5 2>&1 \
      | tail -150 | tee "$OUT/stuck_$3.txt"
  }
  run part 1 part_q0 "" 0
  run part 1 part_q20k "" 20000
  ;;
recovery)
  for fault in ${3//,/ }; do
    timeout 280 python3 benchmarks/recovery_gpu.py --ddp --fault $fault --out "$OUT" $LOCAL $EXTRA \
      2>&1 | tail -60 | tee "$OUT/recovery_$fault${LOCAL:+_local}${EXTRA:+_x}.txt"
    grep -h '"failure_saved"\|"hang"\|"rank_failed"' /tmp/recovery_gpu/events*.jsonl \
      | cut -c1-3000 | tee "$OUT/failure_saved_$fault${LOCAL:+_local}${EXTRA:+_x}.txt"
    cat /tmp/recovery_gpu/stacks_rank*.txt > "$OUT/stacks_$fault.txt" 2>/dev/null
    cat /tmp/recovery_gpu/events*.jsonl | cut -c1-600 > "$OUT/events_$fault${LOCAL:+_local}.jsonl"
  done
  ;;
esac
