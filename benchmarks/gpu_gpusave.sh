#!/usr/bin/env bash
# Issue 50's GPU rows in one device call: the pre-emption save at steps 2, 5, 10, 45
# (this checkout against OLD's guardrails, one disk floor), the snapshot's cost on a
# real 0.835B step (both), where a process's exit goes, and the recovery timeline.
#   bash benchmarks/gpu_gpusave.sh OUT OLD_DIR [sections]
# sections, run in the order given: any of ckpt,ckpt1,snap,exit,tests,recovery
# (default: ckpt,snap,exit,tests)
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

show() {
  PYTHONPATH=$NEW python3 benchmarks/checkpoint_big.py --show "$OUT/checkpoint_big.jsonl" \
    2>&1 > "$OUT/ckpt_show.txt"
}

# SIGTERM at 2, 5, 10, 45 (CKPT_OLD=0: this checkout's only), one disk floor after them.
ckpt() {
  OLDARG=(); [ "${CKPT_OLD:-1}" = 1 ] && OLDARG=(--old-guardrails "$OLD")
  PYTHONPATH=$NEW timeout 330 python3 benchmarks/checkpoint_big.py --dir /tmp \
    --every 20 --sigterm-at ${SIGTERM_AT:-2,5,10,45} "${OLDARG[@]}" --out "$OUT" \
    2>&1 | tail -40 > "$OUT/ckpt_log.txt"
  show
}

# SIGTERM during step 1, before the staging grows for the optimizer's state (OLD pins
# it in the save; this checkout copies it to plain memory), both, no floor of its own.
ckpt1() {
  PYTHONPATH=$NEW timeout 120 python3 benchmarks/checkpoint_big.py --dir /tmp --every 20 \
    --sigterm-at 1 --old-guardrails "$OLD" --no-floor --out "$OUT" \
    2>&1 | tail -20 > "$OUT/ckpt1_log.txt"
  show
}

snap() {
  for v in new old; do
    P=$NEW; [ $v = old ] && P=$OLD
    PYTHONPATH=$P timeout 150 python3 benchmarks/snapshot_cost.py --gpt --every 10 \
      2>&1 | tee "$OUT/snapshot_$v.txt" | grep -v '^RESULT'
  done
}

exit_() {
  PYTHONPATH=$NEW timeout 120 python3 benchmarks/exit_cost.py --device-gb 30 \
    --modes ${EXIT_MODES:-keep,free,os_exit,nopin} 2>&1 | tee "$OUT/exit_cost.txt"
}

tests() {
  PYTHONPATH=$NEW timeout 200 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/loops/test_gpu.py -k "rewind or staging or pinned or signal or snapshot" \
    2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
}

recovery() {
  PYTHONPATH=$NEW timeout 200 python3 benchmarks/recovery_gpu.py \
    --out "$OUT" 2>&1 | tee "$OUT/recovery.txt"
  # What each rank's failure save did (or why not), for the steps redone.
  grep -h '"failure_saved"' /tmp/recovery_gpu/events*.jsonl | cut -c1-700 | tee "$OUT/failure_saved.txt"
}

for s in ${SECTIONS//,/ }; do
  [ "$s" = exit ] && s=exit_
  echo "=== $s $(date -u +%T)"
  $s
done
cat "$OUT/ckpt_show.txt" 2>/dev/null
