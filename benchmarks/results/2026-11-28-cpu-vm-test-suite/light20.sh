#!/bin/bash
# 20 runs of the README's Lightning line and 20 of the emulated bench line, in the fresh CI venv.
source /tmp/venv_d/bin/activate; export PYTHONPATH=/tmp/cc_chk
d=$(mktemp -d); cd $d; ln -s /tmp/cc_chk/examples examples
ok=0; bad=0
for i in $(seq 1 20); do
  python examples/lightning_ddp.py > out.txt 2> err.txt; rc=$?
  if [ $rc -eq 0 ] && ! grep -q "terminate called" err.txt; then ok=$((ok+1)); else bad=$((bad+1)); echo "lightning run $i rc=$rc"; tail -3 err.txt; fi
done
echo "lightning: $ok clean, $bad not"
ok=0; bad=0
for i in $(seq 1 20); do
  sparsecomm emulate --ranks 4 --ranks-per-node 2 --rate 1gbit -- sparsecomm bench --launcher external > out.txt 2> err.txt; rc=$?
  if [ $rc -eq 0 ] && ! grep -q "terminate called" err.txt out.txt; then ok=$((ok+1)); else bad=$((bad+1)); echo "emulate run $i rc=$rc"; tail -3 err.txt; fi
done
echo "emulated bench: $ok clean, $bad not"
