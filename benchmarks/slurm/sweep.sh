#!/usr/bin/env bash
# Submit benchmarks/slurm/bench.sbatch once per world size (one rank per node).
#
#   benchmarks/slurm/sweep.sh [--dry-run] [-p PARTITION] [-A ACCOUNT] [-s SUITE] [-P "2 4 8"]
#                             [-l srun|torchrun] [-t TIME] [-C CONSTRAINT] [-o OUT] [-- SBATCH_ARGS...]
#
#   --dry-run   print the sbatch commands instead of submitting them
#   -p          partition (default: $PARTITION, else normal)
#   -A          account (default: $ACCOUNT, none)
#   -s          suite: allreduce | kernels | ddp | schedules (default: $SUITE, else allreduce)
#   -P          world sizes (default: $SIZES, else "2 4 8 16 32 64 128 256")
#   -l          launcher inside the job (default: $LAUNCHER, else srun)
#   -t          time limit of each job (default: the script's)
#   -C          node constraint, e.g. gpu (default: $CONSTRAINT, none)
#   -o          results folder shared by all jobs (default results/sweep-SUITE-DATE)
# Anything after -- goes to every sbatch (e.g. --gres=gpu:1 --reservation=...).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dry=0
partition=${PARTITION:-normal}
account=${ACCOUNT:-}
suite=${SUITE:-allreduce}
sizes=${SIZES:-"2 4 8 16 32 64 128 256"}
launcher=${LAUNCHER:-srun}
time_limit=""
constraint=${CONSTRAINT:-}
out=""
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
# Print a command so that it can be pasted back into a shell (quoting only what needs it).
show() {
  local a sep=""
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=,%@+-]+$ ]]; then printf '%s%s' "$sep" "$a"; else printf '%s%q' "$sep" "$a"; fi
    sep=" "
  done
  echo
}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry=1 ;;
    -p) partition=$2; shift ;;
    -A) account=$2; shift ;;
    -s) suite=$2; shift ;;
    -P) sizes=$2; shift ;;
    -l) launcher=$2; shift ;;
    -t) time_limit=$2; shift ;;
    -C) constraint=$2; shift ;;
    -o) out=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "sweep.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
case $suite in allreduce|kernels|ddp|schedules) ;; *) echo "sweep.sh: unknown suite '$suite'" >&2; exit 2 ;; esac
# One folder for the whole sweep, so sparsecomm report finds every P side by side.
out=${out:-$ROOT/results/sweep-$suite-$(date +%Y%m%d-%H%M%S)}
[ $dry -eq 1 ] || mkdir -p "$out"

for P in $sizes; do
  cmd=(sbatch -N "$P" -p "$partition" -J "sparsecomm-$suite-P$P" -o "$out/%x-%j.out"
       --chdir="$ROOT" --export="ALL,SUITE=$suite,LAUNCHER=$launcher,OUT=$out,SPARSECOMM_ROOT=$ROOT")
  [ -n "$account" ] && cmd+=(-A "$account")
  [ -n "$constraint" ] && cmd+=(-C "$constraint")
  [ -n "$time_limit" ] && cmd+=(-t "$time_limit")
  cmd+=("$@" "$ROOT/benchmarks/slurm/bench.sbatch")
  if [ $dry -eq 1 ]; then
    show "${cmd[@]}"
  else
    printf 'P=%s: ' "$P"; "${cmd[@]}"
  fi
done
