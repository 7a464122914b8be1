#!/usr/bin/env bash
# Issue 50's GPU rows in one device call: the pre-emption save at steps 2, 5, 10, 45
# (this checkout against OLD's guardrails, one disk floor), the snapshot's cost on a
# real 0.835B step (both), where a process's exit goes, and the recovery timeline.
#   bash benchmarks/gpu_gpusave.sh OUT OLD_DIR [sections]
# sections: any of ckpt,snap,exit,tests,recovery (default: all but recovery)
OUT=${1:?usage: gpu_gpusave.sh OUT OLD_DIR [sections]}
OLD=$(cd "${2:?OLD_DIR}" && pwd)
SECTIONS=${3:-ckpt,snap,exit,tests}
NEW=$PWD
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee "$OUT/machine.txt"
has() { [[ ",$SECTIONS," == *",$1,"* ]]; }
if has ckpt; then
  PYTHONPATH=$NEW timeout 330 python3 benchmarks/checkpoint_big.py --dir /tmp \
    --every 20 --sigterm-at ${SIGTERM_AT:-2,5,10,45} --old-guardrails "$OLD" --out "$OUT" \
    2>&1 | tail -40 > "$OUT/ckpt_log.txt"
  PYTHONPATH=$NEW python3 benchmarks/checkpoint_big.py --show "$OUT/checkpoint_big.jsonl" \
    2>&1 | tee "$OUT/ckpt_show.txt"
fi
if has snap; then
  for v in new old; do
    P=$NEW; [ $v = old ] && P=$OLD
    PYTHONPATH=$P timeout 150 python3 benchmarks/snapshot_cost.py --gpt --every 10 \
      2>&1 | tee "$OUT/snapshot_$v.txt" | grep -v '^RESULT'
  done
fi
if has exit; then
  PYTHONPATH=$NEW timeout 120 python3 benchmarks/exit_cost.py --device-gb 30 2>&1 | tee "$OUT/exit_cost.txt"
fi
if has tests; then
  PYTHONPATH=$NEW timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/loops/test_gpu.py \
    -k "rewind or staging or pinned or signal or snapshot" 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
fi
if has recovery; then
  PYTHONPATH=$NEW timeout 300 python3 benchmarks/recovery_gpu.py --out "$OUT" 2>&1 | tee "$OUT/recovery.txt"
fi
