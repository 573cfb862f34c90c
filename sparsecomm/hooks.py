"""PyTorch DDP communication hooks running sparsecomm's allreduces.

    state = sparsecomm.hooks.SparseHookState(ddp_model, algorithm="oktopk", density=0.01)
    ddp_model.register_comm_hook(state, sparsecomm.hooks.sparse_allreduce_hook)

The hook has the shape every DDP hook has, ``hook(state, bucket) ->
torch.futures.Future[torch.Tensor]``. By default it runs the allreduce
synchronously inside the hook and returns a completed future; DDP then copies
the result into the gradients. With ``SparseHookState(..., overlap=True)`` the
bucket's allreduce is a job on an asynchronous engine
(:class:`sparsecomm.schedules.Engine`, on its own duplicate of the process
group, so it never races DDP's collectives) and the hook returns the pending
future, as DDP's own hooks do: backward goes on while buckets are reduced.

Residuals are kept per *parameter*, not per bucket: DDP rebuilds its buckets
after the first iteration (and a resumed run starts with the default layout
again), so a new bucket layout picks up the residuals of the parameters it
holds. Thresholds and region boundaries are per bucket layout and restart
(exactly) when the layout changes. A bucket holding
the same parameters in another order is copied into its state's layout and
back, so it keeps them, until the same new order comes twice in a row (DDP's
rebuilt buckets, from its second step on): then that order becomes the layout,
with a fresh state that inherits the residuals, and the bucket is reduced in
place from then on. A checkpoint taken after that (from the fourth step on)
therefore resumes bit-identically when the resumed run's rebuilt buckets are
the same (DDP rebuilds them the same way for the same model): its first step,
in the initial order, is copied into the saved layout. Otherwise the first
steps re-evaluate thresholds exactly, and no residual is lost either way.
"""

# No "from __future__ import annotations" here: DDP checks the hook's annotations
# against the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import registry
from .api import allreduce
from .comm import Communicator, resolve
from .state import State, check_density

__all__ = ["SparseHookState", "sparse_allreduce_hook"]


class SparseHookState:
    """State of :func:`sparse_allreduce_hook` for one DDP model.

    Args:
        model: the DDP model (or its module): its parameter order names the
            residuals, so that they survive bucket rebuilds and checkpoints.
        algorithm: a name from ``sparsecomm.algorithms()``.
        density: fraction of entries selected per bucket.
        compressor: how values travel (see ``sparsecomm.compress``), or None.
        op: "avg" (DDP's convention: the sum divided by the world size) or "sum".
        warmup_steps: the first steps reduce every bucket densely (no
            sparsification, no residual), as is usual before sparsifying.
        min_bucket_elements: buckets smaller than this always go dense
            (sparsifying a few thousand values saves nothing).
        error_feedback: keep what was not sent in per-parameter residuals (for
            ``"dense"`` only with a compressor: without one nothing is lost).
        overlap: reduce buckets on a communication thread while backward goes
            on (an engine made here: collective, every rank must build its state
            at the same point). Results are bit for bit those of ``overlap=False``.
            The engine does not pickle: a state unpickled whole runs synchronously
            (same results); to resume overlapping, build a state with
            ``overlap=True`` and ``load_state_dict`` the checkpoint into it.
        engine_threads: torch threads of that communication thread.
        algorithm_options: extra keyword arguments of the algorithm's State
            (e.g. ``{"tau": 32, "tau_prime": 64}`` for Ok-Topk).
        group, comm: which ranks (default: DDP's default process group).

    Statistics: ``stats`` holds, per step, the selected counts, bytes sent and
    seconds of every bucket; ``totals`` running sums.
    """

    def __init__(self, model: torch.nn.Module, algorithm: str = "oktopk", density: float = 0.01, *,
                 compressor: Any = None, op: str = "avg", warmup_steps: int = 0,
                 min_bucket_elements: int = 16384, error_feedback: bool = True,
                 algorithm_options: Optional[dict] = None, group: Any = None, comm: Any = None,
                 overlap: bool = False, engine_threads: int = 1) -> None:
        # Set by the user.
        self.spec = registry.get(algorithm)
        self.algorithm, self.density = algorithm, check_density(density)
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        for name, value in (("warmup_steps", warmup_steps), ("min_bucket_elements", min_bucket_elements)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.compressor, self.op = compressor, op
        self.warmup_steps, self.min_bucket_elements = warmup_steps, min_bucket_elements
        self.error_feedback = error_feedback
        self.algorithm_options = dict(algorithm_options or {})
        self.spec.state_class(density, **self._state_kwargs())  # validate the options now
        self.group, self._comm_arg = group, comm
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        self.overlap = overlap
        # Internal.
        self._engine = None
        if overlap:
            from .schedules.engine import Engine

            self._engine = Engine(group=group, comm=comm, threads=engine_threads, name="sparsecomm-ddp")
        self._param_index = {id(p): i for i, p in enumerate(model.parameters())}
        self._numel = [p.numel() for p in model.parameters()]
        self.step = 0
        self.buckets: Dict[Tuple[int, ...], State] = {}
        self._pending: Dict[int, torch.Tensor] = {}  # per-parameter residuals not yet in a bucket
        self._comm: Optional[Communicator] = None
        self._canonical: Dict[Tuple[int, ...], torch.Tensor] = {}  # per-layout reorder buffers
        self._reordered: Dict[frozenset, Tuple[int, ...]] = {}  # per set: the last order not its layout
        # Statistics.
        self.stats: List[List[dict]] = [[]]
        self.totals = {"steps": 0, "bytes_sent": 0, "dense_buckets": 0, "sparse_buckets": 0}

    def _state_kwargs(self) -> dict:
        kwargs = dict(self.algorithm_options)
        # Dense keeps a residual only when a compressor loses something (q8, fp16, ...):
        # without one it would hold zeros, one more pass per bucket for nothing.
        if self.algorithm != "dense" or self.compressor is not None:
            kwargs.setdefault("error_feedback", self.error_feedback)
        return kwargs

    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = resolve(group=self.group, comm=self._comm_arg)
        return self._comm

    # ---- per-bucket state that survives re-bucketing --------------------------
    def _bucket_state(self, key: Tuple[int, ...], device: torch.device) -> State:
        state = self.buckets.get(key)
        if state is not None:
            return state
        # A new layout: collect the residuals of its parameters from wherever they are.
        self._pending.update(self._residuals_of_other_layouts(set(key)))
        state = self.spec.state_class(self.density, **self._state_kwargs())
        if self.error_feedback and any(i in self._pending for i in key):
            parts = [self._pending.pop(i, None) for i in key]
            state.residual = torch.cat([torch.zeros(self._numel[i], device=device) if r is None
                                        else r.to(device) for i, r in zip(key, parts)])
        self.buckets[key] = state
        return state

    def _residuals_of_other_layouts(self, wanted: set) -> Dict[int, torch.Tensor]:
        found = {}
        for key in [k for k in self.buckets if wanted & set(k)]:
            old = self.buckets.pop(key)
            self.__dict__.get("_canonical", {}).pop(key, None)  # its copy buffer, if it had one
            found.update(self._split(key, old.residual))
        return found

    def _split(self, key: Tuple[int, ...], residual: Optional[torch.Tensor]) -> Dict[int, torch.Tensor]:
        if residual is None:
            return {}
        out, offset = {}, 0
        for i in key:
            out[i] = residual[offset:offset + self._numel[i]].clone()
            offset += self._numel[i]
        return out

    def residuals(self) -> Dict[int, torch.Tensor]:
        """Every parameter's residual, by parameter position in ``model.parameters()``."""
        out = dict(self._pending)
        for key, st in self.buckets.items():
            out.update(self._split(key, st.residual))
        return out

    # ---- checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint needs: step, per-parameter residuals, per-layout algorithm states."""
        algo = {}
        for key, st in self.buckets.items():
            copy = st.__class__.__new__(st.__class__)
            copy.__dict__ = {**st.__dict__, "residual": None}
            algo[key] = copy
        return {"step": self.step, "residuals": self.residuals(), "algorithm_states": algo,
                "totals": dict(self.totals)}

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict`: the step, every parameter's residual, the per-layout states.

        1. A checkpoint of another model (a residual or a layout naming a parameter this
           model lacks, or one of another size) raises ValueError here, not at the first
           bucket.
        2. This hook's settings (algorithm, density, options, error feedback) win, as the
           user just gave them: a saved state made with other settings is dropped (with a
           warning naming both); its residuals carry over to the states this hook makes,
           so the gradient memory goes on while thresholds and boundaries start afresh.
           With the same settings the run resumes bit for bit.
        """
        self._check_checkpoint(d)
        mine = self._settings(self.spec.state_class(self.density, **self._state_kwargs()))
        kept = {key: st for key, st in d["algorithm_states"].items() if self._settings(st) == mine}
        if len(kept) < len(d["algorithm_states"]):
            other = next(st for st in d["algorithm_states"].values() if self._settings(st) != mine)
            warnings.warn(f"SparseHookState.load_state_dict: the checkpoint's bucket states were made with "
                          f"{self._settings(other)}, this hook makes {mine}: their residuals carry over, their "
                          "thresholds and boundaries start afresh", stacklevel=2)
        self.step = d["step"]
        self._canonical, self._reordered = {}, {}  # layouts start over from the saved ones
        self.totals = dict(d["totals"])
        self.buckets = {}
        for key, st in kept.items():
            st.residual = None
            self.buckets[key] = st
        self._pending = {}
        for key in self.buckets:  # re-attach residuals to the saved layouts
            st = self.buckets[key]
            saved = [d["residuals"][i] for i in key if i in d["residuals"]]
            if self.error_feedback and saved:
                st.residual = torch.cat([d["residuals"][i] if i in d["residuals"]
                                         else saved[0].new_zeros(self._numel[i]) for i in key])
        placed = {i for key in self.buckets for i in key}
        self._pending = {i: r for i, r in d["residuals"].items() if i not in placed}

    @staticmethod
    def _settings(state: State) -> tuple:
        """What makes two per-layout states interchangeable: the class and its settings."""
        settings = state.settings()
        settings.pop("iteration", None)
        return (type(state).__name__, tuple(sorted(settings.items())))

    def _check_checkpoint(self, d: dict) -> None:
        """Refuse a checkpoint of another model (see :meth:`load_state_dict`)."""
        n = len(self._numel)
        for i, r in d["residuals"].items():
            if not (isinstance(i, int) and 0 <= i < n):
                raise ValueError(f"SparseHookState.load_state_dict: the checkpoint holds a residual for parameter "
                                 f"{i!r}; this model has {n} parameters (a checkpoint of another model?)")
            if r.numel() != self._numel[i]:
                raise ValueError(f"SparseHookState.load_state_dict: the checkpoint's residual for parameter {i} "
                                 f"has {r.numel()} elements; this model's has {self._numel[i]} (a checkpoint "
                                 "of another model?)")
        for key in d["algorithm_states"]:
            bad = [i for i in key if not (isinstance(i, int) and 0 <= i < n)]
            if bad:
                raise ValueError(f"SparseHookState.load_state_dict: a saved bucket holds parameter(s) {bad}; "
                                 f"this model has {n} parameters (a checkpoint of another model?)")

    def _layout(self, order: Tuple[int, ...]) -> Tuple[int, ...]:
        """The layout (parameter order) the algorithm sees for a bucket of parameters ``order``.

        1. A state keyed by this very order: that order (the bucket is reduced in place).
        2. A state for the same parameters in another order: that state's order (the
           bucket is copied into it and back, ~15 ms per 100 MB on a CPU core), unless
           the previous call of this set came in the same new order too. Then the new
           order becomes the layout (a fresh state that inherits the residuals, as any
           new layout does): DDP rebuilds its buckets once, in gradient-ready order,
           after the first step; a resumed run starts once more in the initial order,
           which is copied for that one step, so it goes on bit for bit.
        3. New parameters: a new state in this order.
        """
        reordered = self.__dict__.setdefault("_reordered", {})  # absent in states pickled before it existed
        members = frozenset(order)
        if order in self.buckets:
            reordered.pop(members, None)
            return order
        held = next((k for k in self.buckets if frozenset(k) == members), None)
        if held is not None and reordered.get(members) != order:
            reordered[members] = order
            return held
        reordered.pop(members, None)
        return order

    def _canonical_buffer(self, key: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A buffer in layout ``key`` for a bucket whose order differs, kept across steps."""
        buffers = self.__dict__.setdefault("_canonical", {})  # absent in states pickled before it existed
        buf = buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = buffers[key] = torch.empty_like(like)
        return buf

    def __getstate__(self) -> dict:  # communicators do not pickle; buffers are rebuilt
        d = dict(self.__dict__)
        d["_canonical"], d["_reordered"] = {}, {}
        d["_comm"] = d["_engine"] = None
        d["group"] = d["_comm_arg"] = None
        return d


def sparse_allreduce_hook(state: SparseHookState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: sparse (or warm-up/small-bucket dense) allreduce of a bucket.

    1. Look up the algorithm state of the bucket's layout (``SparseHookState._layout``:
       the bucket's own order once it has repeated; new layouts inherit the residuals
       of their parameters), copying the bucket into that layout if it differs.
    2. Warm-up steps and small buckets: dense allreduce. Otherwise the
       state's algorithm, with error feedback and the compressor.
    3. Return a future of the reduced bucket (averaged for "avg"), written into
       the bucket's own buffer when its layout allows: completed, or with
       ``overlap=True`` pending on the state's engine (steps 1-3 run there).
    """
    order = [state._param_index[id(p)] for p in bucket.parameters()]
    flat, index, last = bucket.buffer(), bucket.index(), bucket.is_last()
    if state._engine is not None:
        job = state._engine.run(lambda comm: _reduce_bucket(state, flat, order, index, last, comm),
                                what=f"DDP bucket {index}")
        return job.future
    fut = torch.futures.Future()
    fut.set_result(_reduce_bucket(state, flat, order, index, last, state.comm))
    return fut


def _reduce_bucket(state: SparseHookState, flat: torch.Tensor, order: List[int], index: int, last: bool,
                   comm: Communicator) -> torch.Tensor:
    """Steps 1-3 of :func:`sparse_allreduce_hook` for bucket ``index`` on ``comm``."""
    key = state._layout(tuple(order))
    # Reduce in place (DDP's own hooks do the same): into the bucket's buffer, or, for a bucket
    # whose order is not (yet) its state's layout, into a copy in that layout kept per layout,
    # so that no step allocates a bucket-sized tensor.
    copy = key != tuple(order)
    buf = _reorder(flat, order, key, state._numel, out=state._canonical_buffer(key, flat) if copy else None)
    t0 = time.perf_counter()
    before = comm.stats.snapshot()
    dense = state.step < state.warmup_steps or buf.numel() < state.min_bucket_elements
    if dense:
        out = allreduce(buf, algorithm="dense", op=state.op, comm=comm, out=buf)
        selected = buf.numel()
    else:
        st = state._bucket_state(key, buf.device)
        out = allreduce(buf, state=st, op=state.op, compressor=state.compressor, comm=comm, out=buf)
        selected = st.last.global_selected
    delta = comm.stats - before
    state.stats[-1].append({"bucket": index, "numel": buf.numel(), "dense": dense,
                            "selected": selected, "bytes_sent": delta.bytes_sent,
                            "messages": delta.messages_sent, "seconds": time.perf_counter() - t0})
    state.totals["bytes_sent"] += delta.bytes_sent
    state.totals["dense_buckets" if dense else "sparse_buckets"] += 1
    if last:
        state.step += 1
        state.totals["steps"] += 1
        state.stats.append([])
        if len(state.stats) > 1000:  # keep memory bounded on long runs
            del state.stats[:-1000]
    return _reorder(out, list(key), tuple(order), state._numel, out=flat)  # back to the bucket's layout


def _reorder(flat: torch.Tensor, order: List[int], wanted: Tuple[int, ...], numel: List[int],
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``flat`` holds parameters ``order`` one after another; return them in ``wanted`` order.

    Written into ``out`` when given (a tensor like ``flat``), else a new tensor.
    Returns ``flat`` itself when nothing moves, or when the sizes do not add
    up (a bucket that is not exactly its parameters: left as DDP laid it out).
    """
    if list(wanted) == list(order) or sum(numel[i] for i in order) != flat.numel():
        return flat
    starts, pos = {}, 0
    for i in order:
        starts[i] = pos
        pos += numel[i]
    if out is None:
        return torch.cat([flat[starts[i]:starts[i] + numel[i]] for i in wanted])
    pos = 0
    for i in wanted:
        out[pos:pos + numel[i]].copy_(flat[starts[i]:starts[i] + numel[i]])
        pos += numel[i]
    return out
