import os

import pytest
import torch
import torch.multiprocessing

from sparsecomm.tools import launch

import engines
import readme

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
# The gloo ranks of the hook's, the optimizer's and the training tests build DDP models, which
# import torch._dynamo (2.2 s of CPU a rank): the fork server imports it once instead.
launch.preload("torch._dynamo")

def _shares_a_fixture_beyond_the_test(item) -> bool:
    """Whether ``item`` uses one of the tests' own fixtures that outlives a test (module, class,
    package scope): launches of ranks, kernel builds. Split over workers, each would redo it."""
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if defs and defs[-1].scope in ("module", "class", "package") and defs[-1].baseid:
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Units of work for pytest-xdist (``--dist loadgroup``, the default in pyproject.toml).

    1. Tests that share a launch run on one worker: those of the session-wide MPI launch
       (``mpi4``) together; a test using a module-scoped fixture with its module. A README
       line's test names its block's group itself (``readme.group``). Every other test is a
       unit of its own.
    2. The longest units go first (pyproject.toml keeps this order: ``--no-loadscope-reorder``):
       a worker that takes a long unit last leaves the other idle at the end. Those that start
       processes before those that do not, the known long ones (:data:`LONGEST_FIRST`) first.
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            if "mpi4" in item.fixturenames:
                item.add_marker(pytest.mark.xdist_group("mpi4"))
            elif _shares_a_fixture_beyond_the_test(item):
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    def rank(item) -> tuple:
        group = item.get_closest_marker("xdist_group")
        name = group.args[0] if group else item.module.__name__
        known = next((i for i, prefix in enumerate(LONGEST_FIRST) if name.startswith(prefix)), len(LONGEST_FIRST))
        return item.get_closest_marker("slow") is None, known

    items.sort(key=rank)


def pytest_configure(config):
    """Refuse a pytest that pytest-xdist cannot group tests under (``--dist loadgroup``).

    pytest-xdist (up to 3.8 at least) names a test's unit of work by rewriting ``item._nodeid``;
    pytest 9.2 no longer reads it, and the groups fell apart silently: emulated clusters of two
    workers collided, launches shared within a group ran twice. The [test] extra pins pytest
    below 9.2; this says so to an environment made otherwise."""
    if config.getoption("dist", None) != "loadgroup" or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from importlib.metadata import version

    def major_minor(package: str) -> tuple[int, ...]:
        return tuple(int(x) for x in version(package).split(".")[:2] if x.isdigit())

    if major_minor("pytest") >= (9, 2) and major_minor("pytest-xdist") <= (3, 8):
        raise pytest.UsageError(f"pytest {version('pytest')} with pytest-xdist {version('pytest-xdist')} cannot "
                                "keep the tests' units of work together (xdist_group); install the [test] "
                                "extra's versions (pytest<9.2), or run with -n 0")


#: Units known to run longest (``--durations``), by the start of their group or module name.
LONGEST_FIRST = (f"readme:{readme.block_of('sparsecomm train').line}", "readme:", "test_train", "test_training_loops",
                 "mpi4", "test_backends_agree", "test_hooks", "test_hook_loops", "test_examples")


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


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory):
    """Run a README line as typed, once per test process, in a scratch folder its block's lines
    share (a user runs them one after another: ``report`` reads what ``bench`` wrote): its
    completed process. A benchmark suite's line runs with ``readme.SMALL``'s sizes."""
    base = tmp_path_factory.mktemp("readme")
    done: dict = {}

    def run(line: str):
        if line not in done:
            folder = readme.scratch(base / f"block{readme.block_of(line).line}")
            env = readme.user_env(readme.SMALL if readme.runs_a_benchmark_suite(line) else None)
            done[line] = readme.run_line(line, folder, env, timeout=600)
        return done[line]

    return run
