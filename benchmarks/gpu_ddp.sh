#!/usr/bin/env bash
# NCCL evidence on a 2-GPU machine, in one call:  bash benchmarks/gpu_ddp.sh OUT_DIR
# - the GPU tests (cuda:0);
# - `python -m guardrails doctor` (text, JSON, and under torchrun: per-rank differences);
# - the example under torchrun on 2 GPUs (DDP over NCCL) with a NaN sample planted on
#   rank 0: both ranks must skip the same step; then `python -m guardrails report`.
set -o pipefail
OUT=${1:?usage: gpu_ddp.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -q -rs tests/loops/test_gpu.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
python3 -m guardrails doctor 2>&1 | tee "$OUT/doctor.txt"
python3 -m guardrails doctor --json > "$OUT/doctor.json" 2>&1
torchrun --standalone --nproc-per-node 2 -m guardrails doctor 2>&1 | tail -12 | tee "$OUT/doctor_torchrun.txt"
rm -rf /tmp/ddp_run
torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 200 --sample 0 \
  --inject bad_sample --run-dir /tmp/ddp_run 2>&1 | tail -6 | tee "$OUT/ddp_example.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/ddp_example.txt"
import guardrails
rows = guardrails.read_metrics("/tmp/ddp_run").to_pydict()
for r in (0, 1):
    skipped = [s for s, k, rk in zip(rows["step"], rows["skipped"], rows["rank"]) if k and rk == r]
    print(f"rank {r}: skipped steps {skipped}")
PY
python3 -m guardrails report /tmp/ddp_run --no-png 2>&1 | tee "$OUT/ddp_report.txt"
ls /tmp/ddp_run/nonfinite | tee -a "$OUT/ddp_report.txt"
# Pre-emption over NCCL: SIGTERM to rank 0 only at step 100; both ranks must stop at one
# step and save; the same command resumes and finishes (issue 4).
rm -rf /tmp/ddp_sig
torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 200 --sample 0 \
  --inject sigterm --inject-step 100 --run-dir /tmp/ddp_sig 2>&1 | grep -E "stopped|exitcode|done" | tee "$OUT/ddp_sigterm.txt"
torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 200 --sample 0 \
  --inject sigterm --inject-step 100 --run-dir /tmp/ddp_sig 2>&1 | tail -2 | tee -a "$OUT/ddp_sigterm.txt"
python3 -m guardrails inspect /tmp/ddp_sig 2>&1 | tee -a "$OUT/ddp_sigterm.txt"
