#!/usr/bin/env bash
# Everything that needs a GPU, on one machine with one or more CUDA GPUs, in stages:
#
#   benchmarks/gpu/run.sh [install] [tests] [tune] [kernels] [steady] [audit] [profile] [graph] [allreduce]
#   (default: all)
#
#   install    the project, editable, into the current Python without touching its torch
#              (no index: works on a machine cut off from the network); wheels found in
#              .whl/ (e.g. mpich, for mpiexec) are installed first
#   tests      the whole test suite with the GPU visible (the CUDA paths of tests/promises/test_gpu_equals_cpu.py,
#              compiled Triton and CuPy kernels in tests/kernels/), 4 workers
#   tune       benchmarks/gpu/tune_select.py: tile sizes of the Triton selects, against CuPy and torch
#   kernels    benchmarks/test_kernels.py: float32 and bfloat16, Triton vs CuPy vs torch,
#              sizes SPARSECOMM_BENCH_SIZES (default 25M,100M,1B)
#   steady     benchmarks/test_steady_state.py on CUDA: time / add, kernels, copies and
#              host synchronisations per call
#   audit      benchmarks/audit_calls.py on CUDA, Triton compiled: device operations and host
#              synchronisations per steady call at P = 1, 3, 8 (the simulated world's threads
#              share the GPU), the same counts the CPU audit asserts
#   profile    benchmarks/gpu/profile_call.py: the profiler's kernels of a steady call and of the
#              thresholds, by device time, beside the synchronised wall time
#   graph      benchmarks/gpu/graph_probe.py: whether a steady world-size-1 call can be captured
#              in a CUDA graph, and what stops it
#   allreduce  benchmarks/test_allreduce.py: NCCL, a world of one (one GPU); gloo with
#              CUDA tensors, two ranks sharing it
#
# Logs and JSON go to $OUT (default ./gpu_out): env.txt and one .log (and .json) per stage.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install tests tune kernels steady audit profile graph allreduce)
has() { [[ " ${stages[*]} " == *" $1 "* ]]; }
status=0

if has install; then
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
        nproc; free -g | head -2
        if compgen -G ".whl/*.whl" >/dev/null; then
            $PY -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl
        fi
        $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || status=1
        $PY - <<'EOF'
import importlib, shutil, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())), "device", torch.cuda.get_device_name())
for name in ("triton", "cupy", "numba", "mpi4py", "hypothesis", "pytest", "pytest_benchmark", "xdist"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", exc)
print("mpiexec", shutil.which("mpiexec") or "missing")
import sparsecomm
print("sparsecomm", sparsecomm.__version__, sparsecomm.algorithms())
EOF
    } >"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
fi

if has tests; then
    workers=$($PY -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-4}" || echo "")
    timeout "${TESTS_TIMEOUT:-420}" $PY -m pytest -q -p no:cacheprovider $workers -rfEs \
        ${TESTS:-tests} 2>&1 | tee "$OUT/tests.log" | tail -60 || status=1
fi

if has tune; then
    timeout "${TUNE_TIMEOUT:-150}" $PY benchmarks/gpu/tune_select.py 2>&1 | tee "$OUT/tune.log" || status=1
fi

if has kernels; then
    SPARSECOMM_BENCH_SIZES=${SPARSECOMM_BENCH_SIZES:-25000000,100000000,1000000000} \
    SPARSECOMM_BENCH_DTYPES=${SPARSECOMM_BENCH_DTYPES:-float32,bfloat16} SPARSECOMM_BENCH_BACKENDS=${BACKENDS:-auto,triton,cupy,torch} \
    SPARSECOMM_BENCH_ROUNDS=${SPARSECOMM_BENCH_ROUNDS:-10} \
        timeout "${KERNELS_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider -s benchmarks/test_kernels.py \
        --benchmark-json "$OUT/kernels.json" >"$OUT/kernels.log" 2>&1 || status=1
    sed -n '/^sparsecomm kernels on/,/^$/p' "$OUT/kernels.log"; tail -3 "$OUT/kernels.log"
fi

if has steady; then
    SPARSECOMM_STEADY_DEVICE=cuda SPARSECOMM_STEADY_SIZES=${STEADY_SIZES:-25000000,100000000} \
        timeout "${STEADY_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider benchmarks/test_steady_state.py \
        --benchmark-json "$OUT/steady.json" 2>&1 | grep -v "^test_\|^---\|^Name\|^Legend\|^$" \
        | tee "$OUT/steady.log" | tail -40 || status=1
fi

if has audit; then
    TRITON_INTERPRET=0 timeout "${AUDIT_TIMEOUT:-120}" $PY benchmarks/audit_calls.py --device cuda --kernels triton \
        --sizes ${AUDIT_SIZES:-1 3 8} --out "$OUT" 2>&1 | tee "$OUT/audit.log" | tail -40 || status=1
fi

if has profile; then
    timeout "${PROFILE_TIMEOUT:-120}" $PY benchmarks/gpu/profile_call.py 2>&1 | tee "$OUT/profile.log" || status=1
fi

if has graph; then
    timeout "${GRAPH_TIMEOUT:-60}" $PY benchmarks/gpu/graph_probe.py 2>&1 | tee "$OUT/graph.log" || status=1
fi

if has allreduce; then
    {
        echo "---- NCCL, a world of one (one GPU)"
        SPARSECOMM_BENCH_SIZES=25000000,100000000 timeout "${ALLREDUCE_TIMEOUT:-200}" torchrun --nproc-per-node 1 -m pytest -q \
            -p no:cacheprovider benchmarks/test_allreduce.py 2>&1
        echo "---- gloo, 2 ranks sharing one GPU (CUDA tensors staged through the host)"
        SPARSECOMM_DIST_BACKEND=gloo SPARSECOMM_BENCH_SIZES=25000000 timeout "${ALLREDUCE_TIMEOUT:-200}" torchrun --nproc-per-node 2 \
            -m pytest -q -p no:cacheprovider benchmarks/test_allreduce.py 2>&1
    } >"$OUT/allreduce.log" 2>&1 || status=1
    grep -B1 -A6 "^algorithm \|^----" "$OUT/allreduce.log"; grep -E "Error|error" "$OUT/allreduce.log" | head
fi
exit $status
