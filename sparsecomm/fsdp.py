"""Sparse gradient reduction inside FSDP2: a sparse reduce-scatter, or custom HSDP with a sparse
allreduce between replicas.

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = sparsecomm.fsdp.enable(model, density=0.01)                         # flat
    state = sparsecomm.fsdp.enable(model, density=0.01, replicate_group=group)  # custom HSDP

Two modes, for two memory budgets:

* **Flat** (no ``replicate_group``): every FSDP module's reduce-scatter becomes
  :func:`sparsecomm.reduce_scatter`: each rank selects the largest entries of its
  accumulated local gradient and sends each owner only the entries of its shard. The
  residual is the rank's whole local gradient that was not sent: **full size on every
  rank** (the module's padded gradient), which FSDP exists to avoid; ``residual_dtype=
  torch.bfloat16`` halves it. Algorithms: ``"oktopk"`` (its reused local threshold) and
  ``"topkdsa"`` (the exact local top-k): a reduce-scatter over FSDP's fixed, equal shards
  keeps no rebalancing and no global phase.
* **Custom HSDP** (``replicate_group``: the ranks that hold the same shard): FSDP shards
  over a 1-D mesh and reduce-scatters densely there (the fast fabric inside a node); each
  module's all-reduce hook then runs :func:`sparsecomm.allreduce` of the shard across the
  replicas (the slow network). The residual is **shard-sized**. Every registered algorithm.

What ``enable`` sets, per FSDP module (and refuses to take over from the user): SUM
reductions with FSDP dividing by shard size x replicas afterwards (``set_force_sum_reduction_
for_comms``, ``set_gradient_divide_factor``; over a one-rank shard mesh, one GPU a node,
FSDP divides nothing and the hook averages the replicas), and
``set_reduce_scatter_unused_params(True)``: a parameter without a gradient in a step still
takes its place in the reduced layout, where its residual lives (a frozen one has none; one
frozen or unfrozen after ``enable`` is refused at the next reduction). It refuses a native
2-D (HSDP) mesh, several parameter groups or shards
on a dimension other than 0 (``shard_placement_fn``), a custom reduce-scatter or all-reduce
hook already set, an algorithm the mode does not run, and (HSDP) replicas whose shards differ
(one allgather of a digest: FSDP broadcasts nothing).

Gradient accumulation: flat, ``set_requires_gradient_sync(False)`` (FSDP keeps the unsharded
gradient and reduces once). HSDP, also ``set_requires_all_reduce(False)``: the hook keeps the
reduce-scattered shard in a shard-sized accumulator and sends it with the next synced one.
A NaN/Inf on any rank raises :class:`sparsecomm.NonFiniteError` on every rank from
``backward()`` (custom HSDP without a scaler: the node's ranks agree at the end of each
backward, one all-reduce of one number, since a NaN reaches only the shard that holds it);
with ``scaler=`` (a ``torch.amp.GradScaler``) the module's reduced gradient
becomes NaN on every rank instead, so every rank's scaler skips the step. Residuals follow the
scaler's scale. The gradient memory (states, loss scale) is the one the DDP hook and the
schedules keep (:class:`sparsecomm.memory.GradientMemory`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
# FSDP2's interfaces for a custom reduce-scatter and its mesh kinds (torch keeps them private).
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

from . import choice, registry
from .algorithms.reduce_scatter import SHARD_ALGORITHMS
from .api import allreduce, reduce_scatter
from .check import check_replicas_equal, setting_code
from .comm import resolve
from .errors import NonFiniteError
from .memory import GradientMemory, StateMaker, active_scaler, adopt_state, snapshot
from .network import Traffic, TwoLevel, resolve_network
from .state import CallStats, State, check_density, topk_count

__all__ = ["enable", "FSDPState", "MODES", "DESIGNS", "design_traffic", "project"]

#: The algorithms each mode runs.
MODES = {"flat": SHARD_ALGORITHMS, "hsdp": "every registered algorithm"}


class _Module:
    """One FSDP module's part: its parameter group, the layout of what it reduces, its state."""

    def __init__(self, key: str, module: Any, group: Any, names: dict[int, str]) -> None:
        self.key, self.module, self.group = key, module, group
        self.world = group._reduce_scatter_process_group.size()
        #: Per parameter that trains (its name from the root, its padded shard's entries), in
        #: FSDP's order: FSDP reduces no gradient of a frozen one.
        self.params = [(names[id(fp.sharded_param)], fp.padded_sharded_param_size.numel())
                       for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        self.shard = sum(n for _, n in self.params)
        self.calls = 0
        self.pending: torch.Tensor | None = None  # HSDP: reduced shards not yet sent (accumulation)
        self.stored: torch.Tensor | None = None  # the residual between calls in residual_dtype

    def split(self, flat: torch.Tensor, rank_major: bool) -> dict[str, torch.Tensor]:
        """Per parameter name, its part of a flat residual: a shard (HSDP), or (rank-major, the
        flat mode's P x shard layout) the whole padded parameter, its P chunks in order."""
        rows = flat.view(self.world, self.shard) if rank_major else flat.view(1, self.shard)
        out, at = {}, 0
        for name, n in self.params:
            out[name] = rows[:, at:at + n].reshape(-1).clone()
            at += n
        return out

    def join(self, parts: dict[str, torch.Tensor], rank_major: bool) -> torch.Tensor:
        """:meth:`split` undone (ValueError for a missing parameter or another size)."""
        rows = self.world if rank_major else 1
        pieces = []
        for name, n in self.params:
            part = parts.get(name)
            if part is None or part.numel() != rows * n:
                raise ValueError(f"sparsecomm.fsdp: the checkpoint holds no residual of {n * rows} entries for "
                                 f"{name!r} (another model, world size or mode)")
            pieces.append(part.reshape(rows, n))
        return torch.cat(pieces, dim=1).reshape(-1)


class FSDPState:
    """What :func:`enable` keeps per rank: one algorithm state per FSDP module, their statistics.

    ``last``: per module key (its name from the root; ``""`` the root), the last call's
    :class:`~sparsecomm.state.CallStats`; ``totals``: calls, bytes and entries summed over
    every call of every module. :meth:`state_dict` holds this rank's residuals by parameter
    name and every state's thresholds; :meth:`load_state_dict` resumes bit for bit.
    """

    def __init__(self, modules: list[_Module], maker: StateMaker, mode: str, comm: Any, replicas: int,
                 warmup_steps: int, residual_dtype: torch.dtype | None, scaler: Any) -> None:
        self.modules = {m.key: m for m in modules}
        self.mode, self.comm, self.replicas, self.warmup_steps = mode, comm, replicas, warmup_steps
        self.replicate_group = None if comm is None else comm.group
        self.residual_dtype = residual_dtype
        self.memory = GradientMemory(maker, active_scaler(scaler))
        self.states: dict[str, State] = {m.key: maker.make(maker.algorithm) for m in modules}
        self.last: dict[str, CallStats] = {}
        self.totals = {"calls": 0, "dense_calls": 0, "bytes_sent": 0, "local_selected": 0, "global_selected": 0,
                       "refused": 0}
        self._raising = False  # a refusal's error is queued for the end of this backward
        self._agreeing = False  # HSDP: the shard group's agreement is queued for the end of this backward
        self._pending: NonFiniteError | None = None  # a refusal that agreement is to raise

    # ---- one module's reduction --------------------------------------------------
    def _state(self, m: _Module) -> State:
        st = self.states[m.key]
        if m.stored is not None:  # kept in residual_dtype between calls, float32 in them
            st.residual, m.stored = m.stored.float(), None
        return st

    def _park(self, m: _Module, st: State) -> None:
        if self.residual_dtype is not None and st.residual is not None:
            m.stored, st.residual = st.residual.to(self.residual_dtype), None

    def _follow_scale(self) -> None:
        """Residuals times new/old when the scaler's scale moved (checked at every call: it
        moves between steps); those parked in ``residual_dtype`` too (a power of two: exact)."""
        ratio = self.memory.scale.moved()
        self.memory.rescale(ratio, self.states.values())
        if ratio is not None:
            for m in self.modules.values():
                if m.stored is not None:
                    m.stored.mul_(ratio)

    def _record(self, key: str, stats: CallStats) -> None:
        self.last[key] = stats
        t = self.totals
        t["calls"] += 1
        t["bytes_sent"] += stats.bytes_sent
        t["local_selected"] += stats.local_selected
        t["global_selected"] += stats.global_selected

    def _new_pass(self) -> None:
        """A forward begins: no error is queued any more (a backward that failed before its
        end never ran the callback that clears the flags, which would silence later refusals)."""
        self._raising = self._agreeing = False
        self._pending = None

    def _agree_at_the_end(self, m: _Module, shard: torch.Tensor) -> None:
        """HSDP without a scaler, before a backward's first sparse call: queue for its end the
        shard group's agreement on whether any call was refused, so that every rank raises. A
        NaN reaches only the shard that holds it after the node's dense reduce-scatter: alone,
        only that shard's replicas would raise and the others step. One MAX all-reduce of one
        number over the node a backward (and, on a GPU, one read of it)."""
        if self._agreeing or self.memory.scale.scaler is not None or m.world == 1:
            return
        self._agreeing = True
        group, device = m.group._reduce_scatter_process_group, shard.device

        def agree() -> None:
            self._agreeing = False
            exc, self._pending = self._pending, None
            flag = torch.tensor([0.0 if exc is None else 1.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if float(flag) > 0:
                raise exc if exc is not None else NonFiniteError(
                    "sparsecomm.fsdp: a gradient holds NaN/Inf on another shard's replicas: the step is refused "
                    "on every rank", [])

        torch.autograd.Variable._execution_engine.queue_callback(agree)

    def _refused(self, exc: NonFiniteError, out: torch.Tensor) -> None:
        """A call refused on every rank (NaN/Inf somewhere): its reduced gradient becomes NaN on
        every rank, so that every rank's scaler skips the step; without a scaler the error is
        raised once the backward is over (raised inside it, it would leave FSDP's modules
        unsharded and its state mid-backward: the steps after it would not train)."""
        self.totals["refused"] += 1
        out.fill_(float("nan"))
        if self._agreeing:  # HSDP: the agreement raises it, on every rank of the node
            self._pending = self._pending or exc
            return
        if self.memory.scale.scaler is None and not self._raising:
            self._raising = True

            def raise_after_backward() -> None:
                self._raising = False
                raise exc

            torch.autograd.Variable._execution_engine.queue_callback(raise_after_backward)

    def _check_layout(self, m: _Module, entries: int) -> None:
        """Refuse a reduction of another size than the module's layout (a parameter frozen or
        unfrozen since ``enable``): the same on every rank, whose models are the same."""
        want = m.shard * (m.world if self.mode == "flat" else 1)
        if entries != want:
            raise ValueError(f"sparsecomm.fsdp: module {m.key or '(root)'!r} reduces {entries} entries, its layout "
                             f"has {want}: a parameter was frozen or unfrozen after enable(); call enable() "
                             "again on a freshly sharded model")

    def reduce_scatter(self, m: _Module, out: torch.Tensor, flat: torch.Tensor, group: Any) -> None:
        """Flat mode: ``out`` = this rank's shard of the sparse sum of ``flat`` (SUM)."""
        self._check_layout(m, flat.numel())
        m.calls += 1
        if m.calls <= self.warmup_steps:
            (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, flat, group=group)
            self.totals["dense_calls"] += 1
            return
        self._follow_scale()
        st = self._state(m)
        try:
            out.copy_(reduce_scatter(flat, state=st, compressor=self.memory.maker.compressor, group=group))
            self._record(m.key, st.last)
        except NonFiniteError as exc:
            self._refused(exc, out)
        finally:
            self._park(m, st)

    def all_reduce(self, m: _Module, shard: torch.Tensor) -> None:
        """HSDP: ``shard`` (reduce-scattered in the node, SUM) summed over the replicas, in place;
        without an all-reduce due (``set_requires_all_reduce(False)``) kept for the next one.
        A one-rank shard mesh (one GPU a node): FSDP divides nothing after this hook there
        (``enable`` sets it no factor), so the replicas' average is taken here."""
        self._check_layout(m, shard.numel())
        average = m.world == 1
        if not m.group.all_reduce_grads:
            m.pending = shard.to(torch.float32, copy=True) if m.pending is None else m.pending.add_(shard)
            shard.zero_()  # FSDP adds this into .grad after the hook: nothing yet
            return
        if m.pending is not None:
            shard.add_(m.pending.to(device=shard.device, dtype=shard.dtype))  # (loaded on another device)
            m.pending = None
        m.calls += 1
        if m.calls <= self.warmup_steps:
            dist.all_reduce(shard, group=self.replicate_group)
            if average:
                shard.div_(self.replicas)
            self.totals["dense_calls"] += 1
            return
        self._follow_scale()
        self._agree_at_the_end(m, shard)
        st = self._state(m)
        try:
            shard.copy_(allreduce(shard, state=st, op="avg" if average else "sum",
                                  compressor=self.memory.maker.compressor, comm=self.comm))
            self._record(m.key, st.last)
        except NonFiniteError as exc:
            self._refused(exc, shard)
        finally:
            self._park(m, st)

    # ---- checkpoints --------------------------------------------------------------
    def residuals(self) -> dict[str, torch.Tensor]:
        """This rank's residuals by parameter name (float32; zeros before a first sparse call)."""
        out = {}
        for key, m in self.modules.items():
            st = self.states[key]
            flat = m.stored if m.stored is not None else st.residual
            if flat is None:
                flat = torch.zeros(m.shard * (m.world if self.mode == "flat" else 1))
            out.update(m.split(flat.float(), self.mode == "flat"))
        return out

    def state_dict(self) -> dict:
        """This rank's residuals (by parameter name), HSDP's pending accumulations, every
        state's thresholds and counts, the modules' call counts."""
        states = {}
        for key, st in self.states.items():
            copied = snapshot(st)
            copied.residual = None  # (saved by parameter name)
            states[key] = copied
        return {"mode": self.mode, "residuals": self.residuals(), "states": states,
                "calls": {k: m.calls for k, m in self.modules.items()},
                "pending": {k: m.pending.clone() for k, m in self.modules.items() if m.pending is not None},
                "scale": self.memory.scale.value}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (the same model, world and mode; ValueError otherwise)."""
        if d.get("mode") != self.mode or set(d["states"]) != set(self.modules):
            raise ValueError(f"sparsecomm.fsdp: a checkpoint of mode {d.get('mode')!r} over modules "
                             f"{sorted(d['states'])}; this model runs {self.mode!r} over {sorted(self.modules)}")
        for key, m in self.modules.items():
            flat = m.join(d["residuals"], self.mode == "flat")
            st = adopt_state(d["states"][key], self.states[key], "sparsecomm.fsdp", self.memory.maker.like(d["states"][key]))
            st.residual, m.stored = flat.clone(), None
            self.states[key] = st
            self._park(m, st)
            m.calls = d["calls"][key]
            m.pending = d["pending"][key].clone() if key in d["pending"] else None
        self.memory.scale.value = d.get("scale")


class _SparseReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter for one module, made sparse (FSDP calls it with the module's flat,
    padded, rank-major gradient and a shard-sized output)."""

    def __init__(self, state: FSDPState, module: _Module) -> None:
        self.state, self.module = state, module

    def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN201 - FSDP's interface
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN201
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"sparsecomm.fsdp: FSDP asked for {op}; enable() set SUM reductions "
                               "(was set_force_sum_reduction_for_comms turned off?)")
        self.state.reduce_scatter(self.module, output_tensor, input_tensor, group)
        return None


def enable(module: torch.nn.Module, density: float = 0.01, algorithm: str = "oktopk", compressor: Any = None,
           error_feedback: bool = True, replicate_group: Any = None, residual_dtype: torch.dtype | None = None,
           *, warmup_steps: int = 0, algorithm_options: dict | None = None, scaler: Any = None) -> FSDPState:
    """Make every FSDP2 module under ``module`` reduce its gradients sparsely (module docstring).

    Args:
        module: the root of a model after ``fully_shard`` (every FSDP module in it is served).
        density: the fraction of entries each call selects.
        algorithm: flat mode: ``"oktopk"`` or ``"topkdsa"`` (:data:`MODES`); HSDP: any registered
            algorithm.
        compressor: how values travel (``sparsecomm.allreduce``'s).
        error_feedback: keep what was not sent in a residual (default).
        replicate_group: the torch.distributed group of the ranks holding the same shards (custom
            HSDP); None: the flat mode over each module's mesh.
        residual_dtype: None (the work dtype, float32) or ``torch.bfloat16`` between calls.
        warmup_steps: each module's first calls dense (FSDP's own reduce-scatter, or all-reduce).
        algorithm_options: extra keyword arguments of the algorithm's State.
        scaler: a ``torch.amp.GradScaler``: a NaN/Inf skips the step on every rank (module docstring).

    Returns:
        The rank's :class:`FSDPState` (checkpoint it beside the model and optimizer).

    Raises:
        ValueError: on every rank, for what the module docstring lists (every rank calls
            ``enable`` with the same model and arguments).
    """
    check_density(density)
    mode = "flat" if replicate_group is None else "hsdp"
    if mode == "flat" and algorithm not in SHARD_ALGORITHMS:
        raise ValueError(f"sparsecomm.fsdp.enable: the flat mode is a sparse reduce-scatter over FSDP's fixed "
                         f"shards and runs {SHARD_ALGORITHMS}, not {algorithm!r} (with replicate_group=, custom "
                         "HSDP runs every algorithm between replicas)")
    if algorithm not in registry.names():
        raise ValueError(f"sparsecomm.fsdp.enable: unknown algorithm {algorithm!r}; choose from {registry.names()}")
    if residual_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"sparsecomm.fsdp.enable: residual_dtype must be None, torch.float32 or torch.bfloat16, "
                         f"got {residual_dtype}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"sparsecomm.fsdp.enable: warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    found = [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError("sparsecomm.fsdp.enable: no FSDP module under this module; call fully_shard first")
    names = {id(p): n for n, p in module.named_parameters()}
    modules = []
    for name, m in found:
        groups = [g for g in m._get_fsdp_state()._fsdp_param_groups if g is not None]
        if not groups:
            continue  # (a root without parameters of its own)
        if len(groups) > 1:
            raise ValueError(f"sparsecomm.fsdp.enable: FSDP module {name or '(root)'!r} has {len(groups)} parameter "
                             "groups (shard_placement_fn): one layout a module is supported")
        group = groups[0]
        if isinstance(group.mesh_info, DDPMeshInfo):
            raise ValueError("sparsecomm.fsdp.enable: a native 2-D (HSDP) mesh all-reduces densely across replicas "
                             "before any hook; shard over a 1-D mesh and pass replicate_group= for sparse replicas")
        if any(fp.fsdp_placement.dim != 0 for fp in group.fsdp_params):
            raise ValueError(f"sparsecomm.fsdp.enable: FSDP module {name or '(root)'!r} shards a parameter on a "
                             "dimension other than 0 (shard_placement_fn): not supported")
        if group.gradient_divide_factor is not None or group._all_reduce_hook is not None or \
                type(group._reduce_scatter_comm).__name__ != "DefaultReduceScatter":
            raise ValueError(f"sparsecomm.fsdp.enable: FSDP module {name or '(root)'!r} already has a gradient divide "
                             "factor, a custom reduce-scatter or an all-reduce hook; enable() sets them itself")
        modules.append(_Module(name, m, group, names))
    maker = StateMaker(algorithm, density, algorithm_options, error_feedback, compressor, None,
                       dense_keeps_residual=True)
    comm = resolve(group=replicate_group) if replicate_group is not None else None
    replicas = comm.size if comm is not None else 1
    # Every rank must reduce alike: other settings would pair a dense collective with a sparse
    # one (a hang) or other selections. One allgather over the shards, one over the replicas.
    settings = {"density": density, "algorithm": setting_code(algorithm), "warmup_steps": warmup_steps,
                "error_feedback": float(error_feedback), "residual_dtype": setting_code(str(residual_dtype)),
                "compressor": setting_code(str(compressor)), "modules": len(modules)}
    check_replicas_equal(torch.zeros(0), resolve(group=modules[0].group._reduce_scatter_process_group),
                         "sparsecomm.fsdp.enable", settings)
    if comm is not None:  # replicas hold the same shards (FSDP broadcasts nothing)
        local = [fp.sharded_param.to_local().detach().reshape(-1).float() for m in modules for fp in m.group.fsdp_params]
        check_replicas_equal(torch.cat(local), comm, "sparsecomm.fsdp.enable", settings)
    state = FSDPState(modules, maker, mode, comm, replicas, warmup_steps, residual_dtype, scaler)
    module.register_forward_pre_hook(lambda *_: state._new_pass())
    for m in modules:
        m.module.set_force_sum_reduction_for_comms(True)
        if m.world > 1:
            m.module.set_gradient_divide_factor(float(m.world * replicas))
        # (else FSDP copies the gradient, divided by a factor if one is set, and divides by it
        # again after the all-reduce hook: no factor, and the hook averages the replicas)
        m.module.set_reduce_scatter_unused_params(True, recurse=False)
        if mode == "flat":
            m.module.set_custom_reduce_scatter(_SparseReduceScatter(state, m))
        else:
            m.module.set_all_reduce_hook(lambda shard, m=m: state.all_reduce(m, shard))
    return state


#: The sharded designs the traffic model knows: plain FSDP (a dense reduce-scatter over every
#: rank), the flat mode, FSDP2's native HSDP, and custom HSDP with a sparse replica allreduce.
DESIGNS = ("fsdp", "flat", "hsdp", "sparse-hsdp")


def design_traffic(design: str, n: int, density: float, P: int, ranks_per_node: int, algorithm: str = "oktopk",
                   value_bytes: float = 4.0) -> Traffic:
    """One step's critical-path messages and bytes on the busiest rank, between nodes
    (``messages``/``bytes``) and within a node (``intra_*``), for a model of ``n`` gradient
    entries sharded over P ranks in nodes of ``ranks_per_node`` (G).

    1. ``fsdp``: a ring reduce-scatter over all P ranks, (P - 1) messages and n (P - 1) / P
       values; it crosses the nodes' links, so all of it is counted between nodes.
    2. ``flat``: each rank's k = density n entries, a part to each owner (value and a 16-bit
       offset; ``sparsecomm.reduce_scatter``): the collective check's allgather (which carries
       the parts' sizes) and an alltoallv, 2 (P - 1) messages; what leaves the node, (P - G) / P
       of it, between nodes, the rest within.
    3. ``hsdp``: a reduce-scatter within the node (G - 1 messages, n (G - 1) / G values), then a
       ring allreduce of the n / G shard across the R = P / G replicas, between nodes.
    4. ``sparse-hsdp``: the same reduce-scatter within the node, then ``algorithm``'s sparse
       allreduce of the shard across the replicas (its registered model, ``choice.traffic``,
       at k = density n / G).
    """
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    G = max(1, min(ranks_per_node, P))
    R = P // G
    entry = value_bytes + 2
    if design == "fsdp":
        return Traffic(P - 1, n * (P - 1) / P * value_bytes)
    if design == "flat":
        k = topk_count(density, n)
        return Traffic(2 * (P - G), k * (P - G) / P * entry + 8 * (P - G),
                       2 * (G - 1), k * (G - 1) / P * entry + 8 * (G - 1))
    node = (G - 1, n * (G - 1) / G * value_bytes)
    if design == "hsdp":
        return Traffic(2 * (R - 1), 2 * n / G * (R - 1) / R * value_bytes, *node)
    across = choice.traffic(algorithm, n // G, topk_count(density, n // G), R, value_bytes)
    return Traffic(across.messages, across.bytes, *node)


def project(n: int, density: float, world_sizes: "list[int] | tuple[int, ...]", network: Any,
            ranks_per_node: int = 8, algorithm: str = "oktopk") -> list[dict]:
    """Modelled seconds of one step's gradient reduction per design (:func:`design_traffic`) at
    each world size, on ``network`` (a profile name or object; one level: ``intra`` = ``inter``),
    and each design's ratio to plain FSDP's."""
    net = resolve_network(network)
    two = net if isinstance(net, TwoLevel) else TwoLevel(net, net, ranks_per_node, getattr(net, "name", "custom"))
    if isinstance(net, TwoLevel):
        ranks_per_node = net.ranks_per_node
    rows = []
    for P in world_sizes:
        times = {d: design_traffic(d, n, density, P, ranks_per_node, algorithm).time(two) for d in DESIGNS}
        rows += [{"P": P, "design": d, "network": two.name, "n": n, "density": density, "seconds": t,
                  "vs_fsdp": t / times["fsdp"]} for d, t in times.items()]
    return rows
