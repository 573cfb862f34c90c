#!/bin/bash
# The measurements of this folder, alone on the machine, from the repository root:
#   git worktree add --detach /tmp/wt/8a3da7c 8a3da7c && git worktree add --detach /tmp/wt/e00b92d e00b92d
date
python benchmarks/compare_revisions.py 8a3da7c e00b92d WORK --rounds 5 --json benchmarks/results/2026-11-28-cpu-vm-exchange-speed/compare.json > benchmarks/results/2026-11-28-cpu-vm-exchange-speed/compare.md
date
for round in 1 2; do
  for rate in 10gbit 1gbit; do
    for tree in /tmp/wt/8a3da7c "$PWD"; do
      echo "## $rate $tree round $round"
      sparsecomm emulate --ranks 2 --rate $rate -- env PYTHONPATH=$tree CONFIGS="oktopk 1%,oktopk 1% plain" N=25000000 ROUNDS=8 python benchmarks/emulated/rank.py
    done
  done
done > benchmarks/results/2026-11-28-cpu-vm-exchange-speed/emulated.log 2>&1
date
for tree in /tmp/wt/e00b92d "$PWD"; do
  echo "## $tree"
  (cd $tree && PYTHONPATH=$tree python "$PWD"/benchmarks/sim_scale.py --ranks 1024 4096 --n 100000)
done > benchmarks/results/2026-11-28-cpu-vm-exchange-speed/sim_scale.log 2>&1
date

# The tally rung by rung, its buffers in numpy (WORK), with the time outside every phase:
python benchmarks/compare_revisions.py 8a3da7c HEAD WORK --ranks 2 --rounds 5 \
    --json $R/compare_outside.json > $R/compare_outside.md
