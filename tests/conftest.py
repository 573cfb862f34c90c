import os

import pytest
import torch
import torch.multiprocessing

import engines

# A hung collective must fail a test quickly, never stall CI.
os.environ.setdefault("SPARSECOMM_TIMEOUT", "60")
torch.set_num_threads(1)


def _import_triton_for_its_interpreter() -> None:
    """Without a GPU the kernel tests run Triton's interpreter, which can run only Triton's own
    library functions (``tl.sum`` ...) that were defined interpreted, i.e. imported under
    TRITON_INTERPRET=1. Whichever test imports triton first would decide that (an SGD step
    imports it through torch's dynamo), so it is imported here, once, that way."""
    if torch.cuda.is_available() or "triton" in __import__("sys").modules:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401  (optional: the tests skip Triton without it)
    except ImportError:
        pass
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_its_interpreter()

@pytest.fixture(autouse=True)
def _starts_processes_only_when_marked(request, monkeypatch):
    """``-m "not slow"`` must stay in-process: a test that starts gloo ranks or
    mpiexec without saying so fails here instead of silently slowing that run."""
    marks = {m.name for m in request.node.iter_markers()}

    def refuse(what, needed):
        def fail(*args, **kwargs):
            decorators = " ".join(f"@pytest.mark.{name}" for name in needed)
            pytest.fail(f"{request.node.nodeid} {what}: mark it {decorators}", pytrace=False)
        return fail

    # Every gloo launch (engines.run_gloo, sparsecomm.tools.launch.spawn, train.run) goes through here.
    if not {"slow", "gloo"} <= marks:
        monkeypatch.setattr(torch.multiprocessing, "start_processes",
                            refuse("starts gloo processes", ("slow", "gloo")))
    if not {"slow", "mpi"} <= marks:
        monkeypatch.setattr(engines, "run_mpi", refuse("runs mpiexec", ("slow", "mpi")))


#: The MPI cases of four ranks, run together on one ``mpiexec -n 4`` by :func:`mpi4`.
MPI4_CASES = ("comm", "resolve", "allreduce", "bad_input", "properties", "schedules", "engine")


@pytest.fixture(scope="session")
def mpi4():
    """Every rank's result of each of :data:`MPI4_CASES`, by case: one launch for all (a launch
    of four ranks costs about 8 s on two cores). Only tests marked slow and mpi ask for it."""
    if engines.mpiexec() is None:
        pytest.skip("mpi4py/mpiexec not installed")
    runs = engines.run_mpi(4, ",".join(MPI4_CASES), timeout=900)
    return {name: [run[name] for run in runs] for name in MPI4_CASES}


@pytest.fixture
def zero_out_calls(monkeypatch):
    """For each ``kernels.ef_select`` or ``kernels.ef_select_counted`` call the test makes,
    whether it was given a ``zero_out`` (the call itself goes through unchanged)."""
    import sparsecomm

    seen = []

    def spy_on(name):
        fused = getattr(sparsecomm.kernels, name)

        def spy(*args, **kwargs):
            seen.append(kwargs.get("zero_out") is not None)
            return fused(*args, **kwargs)

        monkeypatch.setattr(sparsecomm.kernels, name, spy)

    spy_on("ef_select")
    spy_on("ef_select_counted")
    return seen
