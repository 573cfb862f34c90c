#!/usr/bin/env bash
# usage: count.sh RUNS [collect]: how many of RUNS launches aborted at exit.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
aborted=0
for _ in $(seq 1 "$1"); do
    out=$(OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 "$here/ddp_cycle_at_exit.py" ${2:-} 2>&1)
    grep -q "terminate called without an active exception" <<<"$out" && aborted=$((aborted + 1))
done
echo "${2:-no-collect}: $aborted of $1 launches aborted at exit"
