#!/usr/bin/env bash
# Per-call wall clock of sparse vs dense allreduces on an emulated slow-link cluster (needs root
# and iproute2): P network namespaces joined by a bridge, every port shaped to RATE with tbf
# (../shared/tools/netemu/cluster.sh), one gloo rank per namespace, one thread each.
#   benchmarks/emulated/run.sh P RATE [PYTHON [allreduce|ddp|sched]]      e.g. run.sh 2 1gbit
# Prints rank 0's JSON line: the slowest rank's median seconds per allreduce call (rank.py) or
# per DDP step with each hook (ddp_rank.py) or per step with each schedule (sched_rank.py,
# MODEL=deep|mlp). N and ROUNDS in the environment change the
# allreduce size (default 25M float32) and the timed calls (default 8).
set -u
P=$1; RATE=$2; PYTHON=${3:-python}; SUITE=${4:-allreduce}
SCRIPT=rank.py; [ "$SUITE" = ddp ] && SCRIPT=ddp_rank.py; [ "$SUITE" = sched ] && SCRIPT=sched_rank.py
HERE=$(cd "$(dirname "$0")" && pwd)
NETEMU=${NETEMU:-$HERE/../../../shared/tools/netemu/cluster.sh}
[ "$(id -u)" = 0 ] || { echo "run.sh: needs root (network namespaces)" >&2; exit 2; }
command -v ip >/dev/null || { echo "run.sh: needs iproute2 (ip)" >&2; exit 2; }
"$NETEMU" down "$P" >/dev/null 2>&1
"$NETEMU" up "$P" "$RATE"
trap '"$NETEMU" down "$P"' EXIT
for r in $(seq 0 $((P-1))); do
  ip netns exec "sc$r" env MASTER_ADDR=10.77.0.1 MASTER_PORT=29600 GLOO_SOCKET_IFNAME="scv$r" \
     RANK="$r" WORLD_SIZE="$P" OMP_NUM_THREADS=1 timeout 900 "$PYTHON" "$HERE/$SCRIPT" &
done
wait
