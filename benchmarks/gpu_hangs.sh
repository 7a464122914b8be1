#!/usr/bin/env bash
# Time from fault to error, per scenario and rank, on 2 ranks (NPROC=4: 4 ranks, 4 GPUs):
#     bash benchmarks/gpu_hangs.sh OUT_DIR            # 2 GPUs, NCCL (the default)
#     BACKEND=gloo bash benchmarks/gpu_hangs.sh OUT   # the same on CPU, gloo
#
# Each scenario is tests/hang_worker.py (a small DDP job, the fault on rank 1 after 3
# steps) or the example (--inject stuck / desync), run twice:
#   - under torchrun (MODE torchrun): what a user sees; torchrun tears the job down
#     after the first failure, so the other rank often ends by its SIGTERM;
#   - as two independent processes (MODE procs, like the tests): every rank must end by
#     itself, so every rank's own time to error is measured.
# Per rank: exit code, error class, seconds from the fault to the error (the error
# file's float `time`, written when the rank reported), and the first line of the error.
# Results: OUT_DIR/hangs.json and OUT_DIR/hangs.md; logs under OUT_DIR/<mode>-<scenario>.
# Knobs (env): SCENARIOS (a subset; ONLY=1 leaves out the example desync), BACKEND
# (nccl|gloo), NPROC (2: ranks, one GPU each), HANG_TIMEOUT_S (5), CAP_S (60: wall-clock cap per
# run, `timeout`), MODES ("torchrun procs"), PYTHON (python3).
set -u -o pipefail
OUT=${1:?usage: gpu_hangs.sh OUT_DIR}
BACKEND=${BACKEND:-nccl}
T=${HANG_TIMEOUT_S:-5}
CAP=${CAP_S:-60}
MODES=${MODES:-torchrun procs}
NPROC=${NPROC:-2}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset TORCHELASTIC_ERROR_FILE
if [ "$BACKEND" = nccl ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/machine.txt" 2>&1
  DEVICE=cuda
else
  echo "cpu, $(getconf _NPROCESSORS_ONLN) cores" > "$OUT/machine.txt"
  DEVICE=cpu
fi
$PY -c "import torch; print('torch', torch.__version__)" >> "$OUT/machine.txt" \
  || { echo "gpu_hangs.sh: $PY cannot import torch (set PYTHON=...)" >&2; exit 1; }

SCENARIOS=${SCENARIOS:-"sleep pipe kill raise uneven extra swap example_stuck"}
if [ -z "${ONLY:-}" ] && grep -q '"desync"' examples/train_gpt.py; then SCENARIOS="$SCENARIOS example_desync"; fi

free_port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }

# The command for one rank-set of a scenario (after the launcher part).
target() {
  local s=$1 dir=$2
  case $s in
    example_*) echo "examples/train_gpt.py --steps 40 --sample 0 --device $DEVICE \
--inject ${s#example_} --inject-step 10 --hang-timeout-s $T --run-dir $dir/run" ;;
    *) echo "tests/hang_worker.py $s --backend $BACKEND --hang-timeout-s $T --out $dir" ;;
  esac
}

for mode in $MODES; do
  for s in $SCENARIOS; do
    dir="$OUT/$mode-$s"
    rm -rf "$dir"; mkdir -p "$dir/logs"
    start=$(date +%s.%N)
    if [ "$mode" = torchrun ]; then
      # --log-dir keeps each rank's error.json (and --redirects 3 its output) there.
      timeout -k 5 "$CAP" $PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
        --log-dir "$dir/logs" --redirects 3 $(target "$s" "$dir") > "$dir/torchrun.log" 2>&1
      echo $? > "$dir/rc"
    else
      port=$(free_port)
      for r in $(seq 0 $((NPROC - 1))); do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=$NPROC MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        TORCHELASTIC_ERROR_FILE="$dir/logs/error$r.json" \
          timeout -k 5 "$CAP" $PY $(target "$s" "$dir") > "$dir/logs/rank$r.log" 2>&1 &
        eval "pid$r=$!"
      done
      for r in $(seq 0 $((NPROC - 1))); do
        eval "wait \$pid$r"; echo $? > "$dir/rc$r"; date +%s.%N > "$dir/end$r"
      done
    fi
    awk "BEGIN{print $(date +%s.%N) - $start}" > "$dir/wall_s"
    echo "$mode $s: $(cat "$dir/wall_s") s"
  done
done

$PY - "$OUT" "$T" "$BACKEND" "$MODES" "$NPROC" <<'PY'
import json, re, sys
from pathlib import Path

out, timeout_s, backend, modes = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
nproc = int(sys.argv[5])
rows = []
for d in sorted(p for p in out.iterdir() if p.is_dir()):
    mode, scenario = d.name.split("-", 1)
    fault = None
    if (d / "fault_time").exists():
        fault = float((d / "fault_time").read_text())
    else:  # the example prints "inject: rank R ... at <time>"
        for log in list(d.rglob("*.log")) + list(d.rglob("stdout.log")) + list(d.rglob("stderr.log")):
            m = re.search(r"inject: rank \d+ .* at (\d+\.\d+)", log.read_text(errors="replace"))
            if m:
                fault = float(m.group(1))
    errors = {}
    for f in d.rglob("error*.json"):
        data = json.loads(f.read_text())["message"]
        extra = data.get("extraInfo", {}) if isinstance(data, dict) else {}
        m = re.search(r"(\d+)", f.parent.name if f.name == "error.json" else f.name)
        rank = extra.get("rank")
        if rank is None and m:
            rank = int(m.group(1))
        errors[rank] = {
            "class": extra.get("error_class") or data["message"].split(":", 1)[0],
            "first_line": data["message"].splitlines()[0][:240],
            "seconds_after_fault": None if fault is None or "time" not in extra
            else round(extra["time"] - fault, 2),
        }
    for r in range(nproc):
        rc_file = d / (f"rc{r}" if mode == "procs" else "rc")
        rc = int(rc_file.read_text()) if rc_file.exists() else None
        end_file = d / f"end{r}"
        ended = None
        if fault is not None and end_file.exists():
            ended = round(float(end_file.read_text()) - fault, 2)
        e = errors.get(r, {})
        rows.append({
            "mode": mode, "scenario": scenario, "rank": r,
            "exit_code": rc if mode == "procs" else None,
            "torchrun_exit_code": rc if mode == "torchrun" else None,
            "error_class": e.get("class"),
            "error_s_after_fault": e.get("seconds_after_fault"),
            "process_end_s_after_fault": ended,
            "first_line": e.get("first_line"),
            "wall_s": float((d / "wall_s").read_text()),
        })
meta = {"backend": backend, "hang_timeout_s": timeout_s,
        "machine": (out / "machine.txt").read_text().strip(), "rows": rows}
(out / "hangs.json").write_text(json.dumps(meta, indent=1))
lines = [f"# Fault to error, {nproc} ranks, {backend}, hang_timeout_s={timeout_s:g}", "",
         "```", meta["machine"], "```", "",
         "| mode | scenario | rank | exit | error | error s after fault | process end s | first line |",
         "|---|---|---|---|---|---|---|---|"]
for r in rows:
    code = r["exit_code"] if r["mode"] == "procs" else f"torchrun {r['torchrun_exit_code']}"
    lines.append(
        f"| {r['mode']} | {r['scenario']} | {r['rank']} | {code} | {r['error_class'] or '-'} | "
        f"{r['error_s_after_fault'] if r['error_s_after_fault'] is not None else '-'} | "
        f"{r['process_end_s_after_fault'] if r['process_end_s_after_fault'] is not None else '-'} | "
        f"{(r['first_line'] or '').replace('|', '/')[:160]} |"
    )
(out / "hangs.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
