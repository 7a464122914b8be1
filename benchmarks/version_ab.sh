#!/usr/bin/env bash
# The same benchmark under two versions of guardrails, in alternating processes:
#
#   git worktree add /tmp/base <rev>     # the other version's checkout
#   bash benchmarks/version_ab.sh /tmp/base 4 python3 benchmarks/overhead.py --device cpu --model tiny
#
# Each of ROUNDS rounds runs the command once with BASE's package first on PYTHONPATH
# ("base") and once with this checkout's ("this"), the order alternating between rounds
# so drift (clocks, caches, other load) hits both alike. Every output line is prefixed
# with the round and the version; compare the figures the benchmark prints (for
# overhead.py: each version's guarded - plain paired median).
set -euo pipefail
BASE=${1:?usage: version_ab.sh BASE_DIR ROUNDS COMMAND...}
ROUNDS=${2:?usage: version_ab.sh BASE_DIR ROUNDS COMMAND...}
shift 2
HERE=$(cd "$(dirname "$0")/.." && pwd)
for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then order="base this"; else order="this base"; fi
  for v in $order; do
    if [[ $v == base ]]; then dir=$BASE; else dir=$HERE; fi
    PYTHONPATH="$dir:$dir/examples${PYTHONPATH:+:$PYTHONPATH}" "$@" 2>&1 | sed "s/^/[round $r $v] /"
  done
done
