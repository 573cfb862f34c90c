"""CUDA tensors through every algorithm, compressor and engine; skipped without a GPU.

The same body (:func:`matrix`: every algorithm x compressor, stateless calls in
float32 and bfloat16, and three error-feedback steps) runs on CUDA tensors
and on CPU tensors, and the two must agree:

* simulated world, P = 1, 2, 3 (threads sharing the GPU);
* NCCL, a world of one process (one GPU here; NCCL refuses two ranks on one device);
* gloo, P = 2 and 3 processes sharing the GPU (CUDA buffers staged through the host);
* MPI, ``mpiexec -n 2`` (host staging), against CPU tensors in the same launch;
* the DDP hook on a CUDA model over gloo, two processes, against DDP's own allreduce;
* the seeded property slice (bad input, NaN/Inf, references, conservation) on CUDA.

Agreement is bit for bit: the kernels select the same entries (thresholds are
exact k-th values or come from the same float32 formulas) and every sum adds
the same operands in the same order on both devices. Where a value may differ
by rounding, :data:`ROUNDING_MAY_DIFFER` names it and says why, and that
entry is compared to a tolerance instead.

Kernel by kernel, the tests in ``tests/kernels/`` run Triton compiled on the
GPU (not interpreted) and CuPy whenever a GPU is present (``gpu_paths.runner``).
"""

from __future__ import annotations

import pytest
import torch

import sparsecomm
from sparsecomm import registry

import cases
import engines
import hook_cases
import properties

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.is_available() is False")

ALGORITHMS = sparsecomm.algorithms()
COMPRESSORS = [None, "fp16", "bf16", "trunc16", "fp8", "q8", "q4s"]
N = 20_011
#: Entries whose CUDA value may differ from the CPU's by rounding, and why.
ROUNDING_MAY_DIFFER: dict[str, str] = {
    "dense/None/": "with no compressor, dense is the backend's own allreduce (gloo, NCCL, MPI), "
                   "which adds the ranks in an order of its own (seen: gloo at P = 3, 1 ulp)",
    "cltk/None/": "CLT-k's k values are summed by dense's allreduce, the backend's own with no "
                  "compressor (seen: gloo at P = 3, 1 ulp on 45 of 20,011 entries)",
}


def matrix(rank: int, size: int, device: str, comm=None) -> dict[str, torch.Tensor]:
    """Every algorithm x compressor on ``device``; results and residuals, on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for algorithm in ALGORITHMS:
        for compressor in COMPRESSORS:
            name = f"{algorithm}/{compressor}"
            # A stateless call's stochastic rounding draws from a count of the process's
            # stateless calls, which differs between runs: only the stateful calls compare.
            stateless = [] if compressor == "q4s" else [torch.float32]
            for dtype in [torch.bfloat16] * (compressor is None) + stateless:
                x = cases.inputs(rank, N, "skewed", dtype).to(device)
                got = sparsecomm.allreduce(x, 0.01, algorithm=algorithm, compressor=compressor, comm=comm)
                assert got.device == x.device and got.dtype == dtype, (name, got.device, got.dtype)
                out[f"{name}/{dtype}"] = got.cpu()
            state = registry.get(algorithm).state_class(0.01, error_feedback=True)
            for step in range(3):
                x = cases.inputs(rank + size * step, N, "skewed").to(device)
                out[f"{name}/ef{step}"] = sparsecomm.allreduce(x, state=state, compressor=compressor,
                                                               comm=comm).cpu()
            out[f"{name}/residual"] = state.residual.cpu()
    return out


def compare(got: list[dict], want: list[dict]) -> None:
    """Rank by rank, CUDA results equal the CPU's (bitwise, or to rounding where allowed)."""
    differ = []
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for key in g:
            if torch.equal(g[key], w[key]):
                continue
            d = (g[key].double() - w[key].double()).abs()
            why = next((why for prefix, why in ROUNDING_MAY_DIFFER.items() if key.startswith(prefix)), None)
            if why is not None and torch.allclose(g[key].double(), w[key].double(), rtol=1e-2, atol=1e-2):
                continue
            differ.append(f"rank {rank} {key}: {int((d > 0).sum())} of {d.numel()} differ, "
                          f"largest {float(d.max()):.3g}")
    for rank in range(1, len(got)):  # every rank ends with the same results
        for key in got[rank]:
            if not key.endswith("residual"):
                assert torch.equal(got[rank][key], got[0][key]), f"{key}: rank {rank} != rank 0"
    assert not differ, "CUDA differs from CPU:\n" + "\n".join(differ)


_cpu: dict[int, list] = {}


def cpu_results(P: int) -> list[dict]:
    if P not in _cpu:
        _cpu[P] = sparsecomm.simulate(P, matrix, P, "cpu").results
    return _cpu[P]


@pytest.mark.parametrize("P", [1, 2, 3])
def test_simulated_world_on_cuda_equals_cpu(P):
    compare(sparsecomm.simulate(P, matrix, P, "cuda").results, cpu_results(P))


def test_seeded_property_slice_on_cuda():
    seeds = list(range(60))

    def body(rank, size):
        return [properties.rank_call(properties.build_case(properties.SeededDraw(s), P=size), rank,
                                     device="cuda") for s in seeds]

    res = sparsecomm.simulate(3, body, 3, timeout=60).results
    for i, seed in enumerate(seeds):
        properties.check(properties.build_case(properties.SeededDraw(seed), P=3), [res[r][i] for r in range(3)])


def _engine_matrix(rank, size):
    torch.cuda.set_device(0)
    return matrix(rank, size, "cuda")


@pytest.mark.slow
@pytest.mark.gloo  # the marker of every torch.multiprocessing test, whatever its backend
def test_nccl_world_of_one_equals_cpu():
    from sparsecomm.tools.launch import spawn

    got = spawn(1, _engine_matrix, backend="nccl", timeout=300)
    compare(got, cpu_results(1))


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("P", [2, 3])
def test_gloo_with_cuda_tensors_equals_cpu(P):
    compare(engines.run_gloo(P, _engine_matrix, timeout=300), cpu_results(P))


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(engines.mpiexec() is None, reason="mpi4py/mpiexec not installed")
def test_mpi_with_cuda_tensors_equals_cpu():
    # Against CPU tensors in the same launch, not the simulated world: under mpiexec
    # ``oktopk2l`` takes its ranks per node from the launcher (2 here), the simulated world 1.
    got = engines.run_mpi(2, "matrix_cuda", timeout=300)
    compare([r["cuda"] for r in got], [r["cpu"] for r in got])


def _ddp_cuda(rank, size, algorithm):
    torch.cuda.set_device(0)
    return hook_cases.equals_ddp(rank, size, algorithm, device="cuda")


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("algorithm", ["oktopk", "topka", "dense"])
def test_ddp_hook_on_a_cuda_model_over_gloo(algorithm):
    for worst, totals in engines.run_gloo(2, _ddp_cuda, algorithm, timeout=300):
        assert worst < 1e-5, worst
        assert totals["sparse_buckets"] + totals["dense_buckets"] > 0, totals


def _continue_after_checkpoint(rank, size):
    """Results of 3 calls after a checkpoint: the state kept vs restored with map_location="cpu"."""
    import io

    def x(step):
        return cases.inputs(rank + size * step, N, "skewed").cuda()

    kept = sparsecomm.OkTopkState(0.01, tau=2, tau_prime=3, error_feedback=True)
    for step in range(3):
        sparsecomm.allreduce(x(step), state=kept)
    buf = io.BytesIO()
    torch.save(kept, buf)
    buf.seek(0)
    restored = torch.load(buf, map_location="cpu")
    assert restored.residual.device.type == "cpu"
    a = [sparsecomm.allreduce(x(step), state=kept).cpu() for step in range(3, 6)]
    b = [sparsecomm.allreduce(x(step), state=restored).cpu() for step in range(3, 6)]
    return all(torch.equal(u, v) for u, v in zip(a, b)), restored.residual.device.type


def test_a_state_restored_on_the_cpu_continues_on_cuda_without_losing_its_residual():
    for same, device in sparsecomm.simulate(2, _continue_after_checkpoint, 2).results:
        assert same and device == "cuda"


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("algorithm", ["dense", "oktopk", "topka"])
def test_an_overflowing_accumulation_on_cuda_is_refused_and_leaves_the_residual(kernels, algorithm, monkeypatch):
    # On CUDA the accumulation is the counting pass too (Triton's ef_accumulate, or the torch
    # chain): a residual + gradient that overflows on one rank is refused on every rank, no
    # inf is written into the residual, and the next call goes on. (It was a plain add: the
    # inf stayed, and the state refused every later call.)
    monkeypatch.setenv("SPARSECOMM_KERNELS", kernels)
    big = torch.finfo(torch.float32).max

    def body(rank):
        kwargs = {"tau": 1} if algorithm == "oktopk" else {}
        st = registry.get(algorithm).state_class(0.1, error_feedback=True, **kwargs)
        sparsecomm.allreduce(torch.randn(5000, device="cuda"), state=st)
        st.residual[3] = big if rank == 1 else 0.0
        st.topk_guide = None  # the plain accumulation, not the fused select (TopkA after a call)
        before = st.residual.clone()
        g = torch.zeros(5000, device="cuda")
        g[3] = big
        err = cases.input_error(sparsecomm.allreduce, g, state=st)
        kept = torch.equal(st.residual, before)
        st.residual[3] = 0.0
        out = sparsecomm.allreduce(torch.ones(5000, device="cuda"), state=st)
        return err, kept, bool(torch.isfinite(out).all())

    for err, kept, finite in sparsecomm.simulate(2, body).results:
        assert err is not None and "overflows on rank(s) [1]" in err, err
        assert kept and finite


@pytest.mark.parametrize("backend", [None, "torch", "triton"])
def test_blocked_messages_on_cuda_equal_the_cpu_bytes_and_decode_back(backend):
    # N above is under one 65536-wide block: here several blocks, offsets >= 2**15 and a
    # gathered buffer of blocked, plain and empty messages, on the device's own paths.
    from sparsecomm import kernels
    from sparsecomm.kernels import dispatch

    if backend == "triton" and not dispatch.available("triton", "cuda"):
        pytest.skip("triton cannot run on this GPU")
    gen = torch.Generator().manual_seed(7)
    spans, counts = [5 * 65536 + 3, 10, 9 * 65536, 300_000], [20_000, 0, 3, 9_000]
    bases = [0, spans[0], spans[0] + spans[1], spans[0] + spans[1] + spans[2]]
    parts = [(torch.randperm(s, generator=gen)[:c].sort().values, torch.randn(c, generator=gen))
             for s, c in zip(spans, counts)]
    cpu = torch.cat([kernels.pack_message(i, v, s, torch.int32, torch.float32) for (i, v), s in zip(parts, spans)])
    gpu = torch.cat([kernels.pack_message(i.cuda(), v.cuda(), s, torch.int32, torch.float32, backend=backend)
                     for (i, v), s in zip(parts, spans)])
    assert torch.equal(gpu.cpu(), cpu)
    idx, val = kernels.unpack_messages(gpu, counts, spans, bases, torch.int32, torch.float32, backend=backend)
    assert idx.is_cuda and torch.equal(idx.cpu(), torch.cat([i + b for (i, _), b in zip(parts, bases)]))
    assert torch.equal(val.cpu(), torch.cat([v for _, v in parts]))
