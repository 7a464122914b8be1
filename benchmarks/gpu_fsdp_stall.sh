#!/usr/bin/env bash
# What the step that starts an FSDP2 periodic save waits for, on a 2-GPU machine, in one
# call:  bash benchmarks/gpu_fsdp_stall.sh OUT_DIR [PY_SPY]
# Each run: benchmarks/checkpoint_big.py, FSDP2 over 2 GPUs, foreach AdamW, the first
# save at step 30, SIGTERM at 40, no disk floor (no save is timed whole here):
# - py-spy of both ranks over the save's first 3 s: every thread's Python and native
#   stacks (`native`), then only the GIL holder's (`gil`);
# - the guard's save as it is, with `--sample` (stacks of every step over 0.4 s);
# - controls: no hashing, no disk (/dev/null), no item written; and the same items
#   `torch.save`d by 8 threads with no guard save (`--noise items-save`).
set -o pipefail
OUT=${1:?usage: gpu_fsdp_stall.sh OUT_DIR [PY_SPY]}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPY=${2:-$(command -v py-spy)}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, sys; print(torch.__version__, sys.version)" | tee -a "$OUT/machine.txt"
B="python3 benchmarks/checkpoint_big.py --dir /tmp --nproc 2 --fsdp --foreach --every 30 --sigterm-at 40 --no-floor --out $OUT"
run() { echo "=== $*"; timeout 150 $B "$@"; }
{
  run --spy native
  run --spy gil
  run --sample --sample-over-s 0.4
  run --patch nohash
  run --patch nodisk
  run --patch nowrite
  run --noise items-save
} 2>&1 | tee "$OUT/log.txt"
python3 benchmarks/checkpoint_big.py --show "$OUT/checkpoint_big.jsonl" | tee "$OUT/show.txt"
(cd "$OUT" && tar czf spy.tgz spy_* && rm -f spy_*)
