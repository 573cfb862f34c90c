"""The backend rules (``dispatch.choose``) and the per-operation tables (``dispatch.KernelOp``).

What each backend computes is tested per operation (``test_efselect.py``,
``test_kernel_paths.py``); here: which backend runs, when a table falls back
to torch, that every table entry exists with the operation's signature, and
that the kernel modules import optional libraries only when a path needs them,
and that the Triton interpreter the kernel tests use stays scoped to them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from gpu_paths import HAVE_NUMBA, HAVE_TRITON, interpret_triton

from sparsecomm import kernels
from sparsecomm.kernels import dispatch

AUTO_CPU = "cpu" if HAVE_NUMBA else "torch"  # what auto picks for a CPU tensor here
KERNELS = pathlib.Path(kernels.__file__).parent


def test_choose_rules(monkeypatch):
    x = torch.zeros(4)
    monkeypatch.delenv("SPARSECOMM_KERNELS", raising=False)
    assert dispatch.choose(x) == AUTO_CPU
    assert dispatch.choose(x, "auto") == AUTO_CPU
    assert dispatch.choose(x, "torch") == "torch"
    if HAVE_NUMBA:
        assert dispatch.choose(x, "numba") == dispatch.choose(x, "cpu") == "cpu"
    else:
        with pytest.raises(dispatch.BackendUnavailable, match="pip install numba"):
            dispatch.choose(x, "numba")
    for gpu in ("cupy", "triton"):  # a CPU tensor: never runnable, whatever is installed
        with pytest.raises(dispatch.BackendUnavailable, match="install"):
            dispatch.choose(x, gpu)
    with pytest.raises(dispatch.BackendUnavailable, match="no 'cpu' path"):
        dispatch.choose(x, "cpu", supported=("torch", "triton", "cupy"))
    with pytest.raises(ValueError):
        dispatch.choose(x, "fortran")
    assert dispatch.choose(torch.zeros(4, device="meta")) == "torch"  # other devices: torch


def test_environment_variable_rules(monkeypatch):
    x = torch.zeros(4)
    monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")
    assert dispatch.choose(x) == "torch"
    if HAVE_NUMBA:
        assert dispatch.choose(x, "cpu") == "cpu"  # an explicit backend= wins over the variable
    monkeypatch.setenv("SPARSECOMM_KERNELS", "auto")
    assert dispatch.choose(x) == AUTO_CPU
    monkeypatch.setenv("SPARSECOMM_KERNELS", "triton")  # cannot run on CPU: falls back to auto, warns
    dispatch._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="SPARSECOMM_KERNELS=triton"):
        assert dispatch.choose(x) == AUTO_CPU
    assert dispatch.choose(x, supported=("torch",)) == "torch"
    monkeypatch.setenv("SPARSECOMM_KERNELS", "cpu")  # an operation without a cpu path: no warning
    dispatch._warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.choose(x, supported=("torch", "triton", "cupy")) == "torch"
        # The same through a table without a cpu path.
        op = dispatch.KernelOp("toy_no_cpu", lambda t: "torch", triton="triton_backend:kth_largest")
        try:
            assert op(x) == "torch"
        finally:
            del dispatch.OPS["toy_no_cpu"]
    monkeypatch.setenv("SPARSECOMM_KERNELS", "fortran")
    with pytest.raises(ValueError, match="SPARSECOMM_KERNELS"):
        dispatch.choose(x)


def test_public_ops_raise_for_an_unavailable_backend():
    x = torch.rand(100)
    with pytest.raises(dispatch.BackendUnavailable, match="cannot run on a cpu tensor"):
        kernels.kth_largest(x, 3, backend="triton")
    with pytest.raises(dispatch.BackendUnavailable, match="no 'triton' path"):
        kernels.select_above(x, 0.5, backend="triton")


# (operation, backend asked for, arguments, backend that runs): every table's fallback rule.
_F32, _F64, _F16 = torch.ones(8), torch.ones(8, dtype=torch.float64), torch.ones(8, dtype=torch.float16)
_TH16, _TH17 = np.arange(16, 0, -1.0), np.arange(17, 0, -1.0)
_EMPTY = torch.empty(0)
_FALLBACKS = [
    ("kth_largest", "triton", (_F32, 1, False), "triton"),
    ("kth_largest", "cupy", (_F16, 1, True), "cupy"),
    ("kth_largest", "triton", (_F64, 1, False), "torch"),
    ("kth_largest", "cpu", (_F64, 1, False), "cpu"),
    ("select_above", "cpu", (_F64, 0.0, False), "cpu"),
    ("ef_select", "cpu", (_F32, _F32, 1.0, 8, 1.0, True, None, None), "cpu"),
    ("ef_select", "cpu", (_F32, _F32, 0.0, 8, 1.0, True, None, None), "torch"),
    ("ef_select", "cpu", (_F32, _F32, 1e-46, 8, 1.0, True, None, None), "torch"),  # 0 in float32
    ("ef_select", "cpu", (_F64, _F64, 1e-46, 8, 1.0, True, None, None), "cpu"),
    ("ef_select", "triton", (_F32, _F32, 0.0, 8, 1.0, True, None, None), "triton"),
    ("count_above", "triton", (_F16, _TH16, 1), "triton"),
    ("count_above", "cupy", (_F64, _TH16, 1), "torch"),
    ("count_above", "triton", (_F32, _TH17, 1), "torch"),
    ("count_above", "cpu", (_F64, _TH17, 4), "cpu"),
    ("scatter_add", "triton", (_F32, torch.zeros(1, dtype=torch.int64), _F32[:1]), "triton"),
    ("scatter_add", "cupy", (_F64, torch.zeros(1, dtype=torch.int64), _F64[:1]), "cupy"),
    ("scatter_add", "triton", (_F16, torch.zeros(1, dtype=torch.int64), _F16[:1]), "torch"),
    ("scatter_add", "cpu", (_F64, torch.zeros(1, dtype=torch.int64), _F64[:1]), "cpu"),
    ("scatter_add", "cpu", (_F16, torch.zeros(1, dtype=torch.int64), _F16[:1]), "torch"),
    ("scatter_add", "cpu", (_F32, torch.zeros(2, dtype=torch.int64), _F32[:1]), "torch"),  # lengths differ
    ("scatter_add", "cpu", (_F32.reshape(2, 4), torch.zeros(1, dtype=torch.int64), _F32[:1]), "torch"),
    ("topk_of_candidates", "cpu", (torch.arange(8), _F16, 3), "torch"),  # below 4096 candidates
    ("topk_of_candidates", "cpu", (torch.arange(5000), torch.ones(5000, dtype=torch.float16), 3), "cpu"),
    ("topk_of_candidates", "cpu", (torch.arange(5000), torch.ones(5000), 0), "torch"),
    ("bucketize", "cpu", (_F64, _F64[:3]), "cpu"),
    ("bucketize", "cpu", (_F16, _F16[:3]), "torch"),
    ("pack_records", "triton", (torch.arange(8), _F32, torch.int32, torch.float32, None), "triton"),
    ("pack_records", "cupy", (torch.arange(0), _EMPTY, torch.int32, torch.float32, None), "torch"),
    ("unpack_records", "triton", (torch.zeros(1, 8, dtype=torch.uint8), torch.int32, torch.float32), "triton"),
    ("encode_codes", "cpu", (_F16, 4, 1.0), "cpu"),
    ("encode_codes", "triton", (_EMPTY, 4, 1.0), "torch"),
    ("decode_codes", "cupy", (torch.zeros(4, dtype=torch.uint8), 4, 8, 1.0, torch.float32), "cupy"),
    ("decode_codes", "cpu", (torch.zeros(4, dtype=torch.uint8), 4, 8, 1.0, torch.bfloat16), "torch"),
    ("decode_codes", "triton", (torch.zeros(4, dtype=torch.uint8), 4, 0, 1.0, torch.float32), "torch"),
]


@pytest.mark.parametrize("op,asked,args,runs", _FALLBACKS,
                         ids=[f"{f[0]}-{f[1]}-{i}" for i, f in enumerate(_FALLBACKS)])
def test_table_fallback_rules(op, asked, args, runs):
    assert dispatch.OPS[op].fallback(asked, *args) == runs
    assert dispatch.OPS[op].fallback("torch", *args) == "torch"


def test_every_op_has_its_table_and_every_entry_its_signature():
    # Backend modules import their libraries lazily, so every entry resolves here,
    # also the CuPy ones that cannot run: a mismatched contract fails without a GPU.
    with_backend = {name for name in kernels.__all__
                    if inspect.isfunction(getattr(kernels, name))
                    and "backend" in inspect.signature(getattr(kernels, name)).parameters}
    # These pass backend= on: to count_above, to ef_select.
    assert set(dispatch.OPS) == with_backend - {"estimate_threshold", "ef_select_counted"}
    for op in dispatch.OPS.values():
        ref = inspect.signature(op.implementation("torch")).parameters
        for backend in op.backends:
            impl = op.implementation(backend)
            params = list(inspect.signature(impl).parameters.values())
            assert len(params) == len(ref), (op.name, backend, params)
            assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params), (op.name, backend)


def test_kernel_op_validates_its_table_and_falls_back(monkeypatch):
    monkeypatch.setattr(dispatch, "OPS", dict(dispatch.OPS))  # keep the toy tables out of the registry
    with pytest.raises(ValueError, match="unknown kernel backend"):
        dispatch.KernelOp("toy", lambda x: x, fortran="numba_backend:kth_largest")
    with pytest.raises(ValueError, match="module:function"):
        dispatch.KernelOp("toy", lambda x: x, cpu="numba_backend.kth_largest")
    with pytest.raises(ValueError, match="not in the table"):
        dispatch.KernelOp("toy", lambda x: x, cpu="numba_backend:kth_largest", accepts={"triton": bool})
    calls = []
    toy = dispatch.KernelOp("toy", lambda x, th, use_abs: calls.append(th) or "ref",
                            cpu="numba_backend:select_above", accepts={"cpu": lambda x, th, use_abs: th > 0})
    assert toy.backends == ("torch", "cpu") and dispatch.OPS["toy"] is toy
    assert toy(torch.ones(3), -1.0, False, backend="cpu" if HAVE_NUMBA else "torch") == "ref"
    assert calls == [-1.0]
    with pytest.raises(dispatch.BackendUnavailable, match="no 'triton' path"):
        toy(torch.ones(3), 1.0, False, backend="triton")
    with pytest.raises(dispatch.BackendUnavailable, match="no 'cupy' path"):
        toy.run("cupy", torch.ones(3), 1.0, False)


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_optional_libraries_are_imported_only_by_the_paths_that_need_them():
    out = _run_python(
        "import sys, torch\n"
        "from sparsecomm import kernels\n"
        "from sparsecomm.kernels import dispatch\n"
        "opt = {'numba', 'triton', 'cupy'}\n"
        "assert not opt & set(sys.modules), opt & set(sys.modules)\n"
        "kernels.kth_largest(torch.rand(100), 3, backend='torch')\n"
        "kernels.scatter_add(torch.zeros(4), torch.tensor([1]), torch.ones(1), backend='torch')\n"
        "for op in dispatch.OPS.values():\n"
        "    for b in op.backends: op.implementation(b)  # the backend modules, not their libraries\n"
        "assert not opt & set(sys.modules), opt & set(sys.modules)\n"
        "print('ok')\n")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def _sibling_imports(path: pathlib.Path) -> set[str]:
    # Every import of another kernels module, also those inside functions (lazy ones).
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            text = ast.unparse(arg) if arg is not None else ""
            found.update(m for m in ("_triton_jit", "_numba_jit", "_cupy_jit") if m in text)
    return found


def test_kernel_modules_import_without_cycles():
    # Operation modules name backends only in their tables' strings; backends may use the
    # operations' helpers. Any import cycle (also through lazy imports) fails here.
    graph = {p.stem: _sibling_imports(p) for p in KERNELS.glob("*.py") if p.stem != "__init__"}
    backends = {m for m in graph if m.endswith("_backend") or m.endswith("_jit")}
    for module, deps in graph.items():
        if module not in backends:
            assert not deps & backends, (module, deps & backends)
    state: dict[str, int] = {}

    def visit(m: str, trail: tuple[str, ...]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, f"import cycle: {' -> '.join(trail + (m,))}"
        state[m] = 1
        for d in graph.get(m, ()):
            visit(d, trail + (m,))
        state[m] = 2

    for m in graph:
        visit(m, ())
    assert "numba_backend" in graph and "efselect" not in graph["numba_backend"]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the tests compile Triton kernels, and an "
                    "interpreted run patches triton.language for the whole process (Triton 3.6: later "
                    "compiles then fail), so no test interprets there")
@pytest.mark.parametrize("compiled_first", [False, True], ids=["no_kernels_yet", "compiled_kernels"])
def test_triton_interpreter_is_scoped_to_the_tests_that_ask_for_it(compiled_first):
    # gpu_paths.interpret_triton (behind gpu_paths.runner) must leave no
    # TRITON_INTERPRET and no interpreted kernels behind for later tests, and
    # give back compiled kernels imported before (a GPU machine's state).
    jit_name = "sparsecomm.kernels._triton_jit"
    with pytest.MonkeyPatch.context() as outer:
        outer.delenv("TRITON_INTERPRET", raising=False)
        outer.setitem(sys.modules, jit_name, None)
        del sys.modules[jit_name]
        outer.setattr(kernels, "_triton_jit", None, raising=False)
        if compiled_first:
            importlib.import_module(jit_name)
        jit_before = sys.modules.get(jit_name)
        with pytest.MonkeyPatch.context() as mp:
            interpret_triton(mp)
            assert os.environ["TRITON_INTERPRET"] == "1" and sys.modules[jit_name] is not jit_before
            out = torch.zeros(4)
            dispatch.OPS["scatter_add"].run("triton", out, torch.tensor([1, 1]), torch.ones(2))  # interpreted
            assert out.tolist() == [0, 2, 0, 0]
        assert "TRITON_INTERPRET" not in os.environ
        assert sys.modules.get(jit_name) is jit_before
        assert getattr(kernels, "_triton_jit", None) is jit_before


def test_an_operation_can_prefer_its_own_order():
    x = torch.rand(100)
    op = dispatch.KernelOp("toy_prefer", lambda x: "torch", cpu="numba_backend:kth_largest",
                           prefer={"cpu": ("torch", "cpu")})
    try:
        assert op.choice(x) == "torch"  # the default order would take cpu (numba) where it imports
        if HAVE_NUMBA:
            assert op.choice(x, backend="cpu") == "cpu"  # an explicit choice still wins
        assert dispatch.OPS["ef_select"].prefer == dispatch.CUDA_SCANS
        assert dispatch.OPS["ef_select"].choice(torch.ones(4), torch.ones(4), 1.0, 4, 1.0, True, None, None) \
            == ("cpu" if HAVE_NUMBA else "torch")  # a CUDA order leaves the CPU's alone
    finally:
        del dispatch.OPS["toy_prefer"]


def test_upload_builds_the_tensor_a_to_host_read_gives_back():
    from sparsecomm.kernels import dispatch

    got = dispatch.upload([3, 1, 2], torch.int64, "cpu")
    assert got.dtype == torch.int64 and dispatch.to_host(got) == [3, 1, 2]
    grid = torch.tensor([0.5, 1.0], dtype=torch.float64)
    assert torch.equal(dispatch.upload(grid, torch.float32, "cpu"), grid.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.is_available() is False")
def test_upload_to_a_gpu_does_not_synchronise():
    # A pageable copy would wait for the stream (PyTorch's memcpy_and_sync): the sync debug
    # mode raises on it. The pinned, asynchronous copy must not.
    from sparsecomm.kernels import dispatch

    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        busy @ busy  # the stream has work queued
        got = dispatch.upload(list(range(17)), torch.int64, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.cpu().tolist() == list(range(17))
