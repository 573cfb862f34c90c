"""PyTorch DDP communication hooks running sparsecomm's allreduces.

    state = sparsecomm.hooks.SparseHookState(ddp_model, algorithm="oktopk", density=0.01)
    ddp_model.register_comm_hook(state, sparsecomm.hooks.sparse_allreduce_hook)

The hook has the shape every DDP hook has, ``hook(state, bucket) ->
torch.futures.Future[torch.Tensor]``. By default it reduces synchronously
inside the hook; with ``SparseHookState(..., overlap=True)`` every bucket is a
job on an asynchronous engine (:class:`sparsecomm.schedules.Engine`, on its own
duplicate of the process group, so it never races DDP's collectives) and the
hook returns a pending future, as DDP's own hooks do: backward goes on while
buckets are reduced. Both give the same results bit for bit.

Layouts. Residuals are kept per *parameter*; thresholds and region boundaries
per *layout*, a tuple of parameters the algorithm reduces as one buffer. DDP's
first step after a (re)start uses its initial buckets and later steps the ones
it rebuilt in gradient-ready order, which may hold other parameter sets. So a
bucket whose parameters all belong to layouts the state holds is *staged*: its
gradients are copied into those layouts' buffers, a layout is reduced (in its
own buffer, with its own state) once all its parameters came in this step, and
the results are copied back; the bucket's future completes when all its
parameters are reduced (DDP calls the hook for every bucket in index order on
every rank, and waits for the futures only at the end of backward, so every
rank makes the same collectives in the same order). A bucket order staged in
two steps in a row becomes a layout (a fresh state inheriting the residuals
of its parameters): a fresh run ends up reducing DDP's rebuilt buckets in
place, with no copies. A bucket holding parameters no layout holds becomes a
layout at once. The first step after ``load_state_dict`` takes its layout
decisions from the orders of the step before the checkpoint, not from the
buckets DDP happens to start with, so a run resumed from a checkpoint taken
from the second step on goes on bit for bit as the uninterrupted run, when
DDP rebuilds the same buckets (it does, for the same model).

Refusals. A reduction refused with :class:`~sparsecomm.errors.InputError`
(NaN/Inf in a gradient, mismatched buckets) is refused on every rank alike;
its gradient is dropped like a skipped batch (its residuals stay as they were),
and the step is *refused*: the results of its other reductions, whose
residuals already gave them up, are *carried* (kept per parameter and added to
the same parameters' results at the next step that is not refused), so nothing
else is lost. The error reaches the caller as itself (its own type, on every
rank), raised by ``backward()`` once DDP has finished the backward pass (so DDP
is ready for the next iteration); the caller skips ``optimizer.step()``, calls
``optimizer.zero_grad()`` and goes on. Raising inside the hook instead leaves
DDP's reducer broken for every later iteration, and failing the future hands
DDP an exception object it cannot cast to a tensor. With ``scaler=`` (a
``torch.amp.GradScaler``), a :class:`~sparsecomm.errors.NonFiniteError` is not
raised: the refused parameters' results are Inf on every rank, the scaler skips
the step and lowers its scale, and the residuals and carried results, kept in
scaled units, follow the scale. Any other error (a timeout, a dead peer) leaves
the ranks out of step: it is raised the same way, and every later step raises it
again without communicating.
"""

# No "from __future__ import annotations" here: DDP checks the hook's annotations
# against the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .api import allreduce
from .comm import Communicator, resolve
from .errors import InputError, NonFiniteError
from .hook_layouts import Layout, Layouts
from .memory import GradientMemory, StateMaker, active_scaler
from .schedules.engine import Engine
from .state import State, check_density

__all__ = ["SparseHookState", "sparse_allreduce_hook"]

class _Waiting:
    """A bucket whose future is not complete yet: its buffer, order and unreduced parameters."""

    def __init__(self, flat: torch.Tensor, order: Layout, future: torch.futures.Future) -> None:
        self.flat, self.order, self.future = flat, order, future
        self.remaining = set(order)
        self.error: Optional[BaseException] = None


class _Step:
    """The hook calls of one backward pass: what the layout rules saw and what was reduced.

    Made on the caller's thread at the step's first bucket (``scale``, whether it
    runs inside backward); read and written on the thread that reduces.
    """

    def __init__(self, scale: Optional[float], in_backward: bool) -> None:
        self.scale, self.in_backward = scale, in_backward
        self.started = self.ended = self.pretend = False
        self.orders: List[Layout] = []  # bucket orders the layout rules saw, in order
        self.staged: List[Layout] = []  # those of them staged into held layouts
        self.arrived: Dict[Layout, set] = {}  # held layout -> its parameters staged so far
        self.waiting: List[_Waiting] = []
        self.results: List[Tuple[Layout, torch.Tensor]] = []  # reductions that went through
        self.refused = False
        self.error: Optional[BaseException] = None
        self.reported = False


class SparseHookState:
    """State of :func:`sparse_allreduce_hook` for one DDP model.

    Args:
        model: the DDP model (or its module): its parameter order names the
            residuals, so that they survive bucket rebuilds and checkpoints.
        algorithm: a name from ``sparsecomm.algorithms()``, or ``"auto"``: per layout, the one
            ``sparsecomm.choose`` picks for its size, kept (in checkpoints too); no options then.
        density: fraction of entries selected per layout.
        compressor: how values travel (see ``sparsecomm.compress``), or None.
        op: "avg" (DDP's convention: the sum divided by the world size) or "sum".
        warmup_steps: the first steps reduce every bucket densely (no
            sparsification, no residual), as is usual before sparsifying.
        min_bucket_elements: layouts smaller than this always go dense
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
        network: the profile ``"auto"`` models (``sparsecomm.choice.profile``).
        scaler: the ``torch.amp.GradScaler`` that scales the loss, or None. With
            it, NaN/Inf in a gradient gives Inf results (the scaler skips the step
            on every rank) instead of a :class:`~sparsecomm.errors.NonFiniteError`,
            and residuals follow the scale (read once per step). Not pickled.

    Statistics: ``stats`` holds, per step, one row per reduction (its layout,
    selected count, bytes sent, seconds, whether it was staged or refused);
    ``totals`` running sums.
    """

    def __init__(self, model: torch.nn.Module, algorithm: str = "oktopk", density: float = 0.01, *,
                 compressor: Any = None, op: str = "avg", warmup_steps: int = 0,
                 min_bucket_elements: int = 16384, error_feedback: bool = True,
                 algorithm_options: Optional[dict] = None, group: Any = None, comm: Any = None,
                 overlap: bool = False, engine_threads: int = 1, scaler: Any = None,
                 network: Any = None) -> None:
        # Set by the user.
        self.algorithm, self.density, self.network = algorithm, check_density(density), network
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        for name, value in (("warmup_steps", warmup_steps), ("min_bucket_elements", min_bucket_elements)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.compressor, self.op = compressor, op
        self.warmup_steps, self.min_bucket_elements = warmup_steps, min_bucket_elements
        self.error_feedback = error_feedback
        self.algorithm_options = dict(algorithm_options or {})
        maker = StateMaker(algorithm, self.density, self.algorithm_options, error_feedback, compressor, network,
                           dense_keeps_residual=False)
        self.group, self._comm_arg = group, comm
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        # A disabled scaler (enabled=False, an fp32 run's switch) is no scaler: NaN/Inf must raise.
        self.overlap, self.scaler = overlap, active_scaler(scaler)
        # Residuals no layout's state holds, results of refused steps, the scale they are in.
        self._memory = GradientMemory(maker, self.scaler)
        # Internal.
        self._engine = None
        if overlap:
            self._engine = Engine(group=group, comm=comm, threads=engine_threads, name="sparsecomm-ddp")
        self._param_index = {id(p): i for i, p in enumerate(model.parameters())}
        self._numel = [p.numel() for p in model.parameters()]
        self.step = 0
        self._layouts = Layouts(self._numel)  # which parameters reduce as one buffer, with which state
        self._resumed = False  # the next step is the first after load_state_dict
        self._broken: Optional[BaseException] = None
        self._comm: Optional[Communicator] = None
        self._calling: Optional[_Step] = None  # the step the caller's thread is in
        self._live: Optional[_Step] = None  # the step the reducing thread is in
        # Statistics.
        self.stats: List[List[dict]] = [[]]
        self.totals = {"steps": 0, "bytes_sent": 0, "dense_buckets": 0, "sparse_buckets": 0, "refused_steps": 0}

    @property
    def layout_states(self) -> Dict[Layout, State]:
        """The algorithm states of the held layouts reduced sparsely, by layout."""
        return self._layouts.states

    @property
    def buckets(self) -> Dict[Layout, State]:
        """The old name of :attr:`layout_states` (a DDP bucket is not a layout); it will go."""
        warnings.warn("SparseHookState.buckets is now layout_states", DeprecationWarning, stacklevel=2)
        return self.layout_states

    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = resolve(group=self.group, comm=self._comm_arg)
        return self._comm

    # ---- per-parameter memory and checkpoints ---------------------------------------
    def residuals(self) -> Dict[int, torch.Tensor]:
        """Every parameter's residual, by parameter position in ``model.parameters()``."""
        return self._layouts.residuals(self._memory)

    def carried(self) -> Dict[int, torch.Tensor]:
        """Results of refused steps not applied yet (added at the next step), by parameter position."""
        return {i: c.clone() for i, c in self._memory.carry.values.items()}

    def state_dict(self) -> dict:
        """What a checkpoint needs (take it between steps): step, per-parameter residuals and carried
        results, per-layout algorithm states, the layouts and the last step's orders, the scale."""
        memory = self._memory.state_dict()
        return {"step": self.step, "residuals": self.residuals(), "totals": dict(self.totals),
                "carried": memory["carried"], "scale": memory["scale"], **self._layouts.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict`: the step, every parameter's residual, the layouts and their states.

        1. A checkpoint of another model (a residual, carried result or layout naming
           a parameter this model lacks, or one of another size) raises ValueError
           here, not at the first bucket.
        2. This hook's settings (algorithm, density, options, error feedback) win, as the
           user just gave them: a saved state made with other settings is dropped (with a
           warning naming both); its residuals carry over to the states this hook makes,
           so the gradient memory goes on while thresholds and boundaries start afresh.
           With the same settings the run resumes bit for bit.
        3. The next step takes its layout decisions from the orders of the step before
           the checkpoint; DDP's initial buckets are staged into them.
        """
        self._layouts.check(d)
        self._memory.load_state_dict({"carried": d.get("carried", {}), "scale": d.get("scale")})
        self._layouts.load(d, self._memory)  # the residuals: into the saved layouts' states, the rest parked
        self.step = d["step"]
        self.totals = {"refused_steps": 0, **d["totals"]}
        self._calling, self._live, self._broken = None, None, None
        self._resumed = True

    def __getstate__(self) -> dict:  # communicators, engines and scalers do not pickle; buffers are rebuilt
        d = dict(self.__dict__)
        d["_comm"] = d["_engine"] = d["scaler"] = d["_calling"] = d["_live"] = d["_broken"] = None
        d["group"] = d["_comm_arg"] = None
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(_upgrade_pickled(d))

    # ---- one step's reductions (on the reducing thread, in bucket order) -------------
    def _open_call(self, index: int, last: bool) -> _Step:
        """On the caller's thread: the step this bucket belongs to, made at its first bucket.

        There the scaler's scale is read (one host read per step on CUDA) and, inside
        backward, a final callback is queued that queues :meth:`_report`: DDP queues
        its own finalisation after the last bucket, so a callback queued by a callback
        runs after it, when DDP has copied every result and is ready for the next
        iteration.
        """
        step = self._calling
        if step is None or index == 0:
            scale = float(self.scaler.get_scale()) if self.scaler is not None else None
            step = _Step(scale, False)
            engine = torch.autograd.Variable._execution_engine
            try:
                engine.queue_callback(lambda: engine.queue_callback(lambda: self._report(step)))
                step.in_backward = True
            except RuntimeError:  # not inside backward (a bucket driven by hand): futures carry errors
                pass
            self._calling = step
        if last:
            self._calling = None
        return step

    def _report(self, step: _Step) -> None:
        """At the end of backward: raise the step's error, the very object, on every rank."""
        if step.error is not None and not step.reported:
            step.reported = True
            raise step.error

    def _arrive(self, step: _Step, flat: torch.Tensor, order: Layout, index: int, last: bool,
                future: torch.futures.Future, comm: Communicator) -> None:
        """Take bucket ``index``: reduce it, or stage it; complete the futures that are due.

        Never raises: an error is recorded in ``step`` (and in the futures when the
        step does not run inside backward), so that every future completes.
        """
        done: List[_Waiting] = []  # completed after this call's bookkeeping, so _report sees it
        try:
            if self._live is not step:
                if self._live is not None and not self._live.ended:  # a backward left half-way
                    self._end_step(self._live, index, comm, done)
                self._live = step
                self._start_step(step)
            bucket = _Waiting(flat, order, future)
            step.waiting.append(bucket)
            if self._broken is not None:
                raise self._broken
            self._take(step, bucket, index, comm, done)
            if last:
                self._end_step(step, index, comm, done)
        except BaseException as exc:  # noqa: BLE001 - a timeout, a dead peer: the ranks are out of step
            self._broken = exc
            step.error = step.error or exc
            for w in step.waiting:
                w.error = w.error or exc
                done.append(w)
            step.waiting = []
            if last:
                step.ended = True
        finally:
            for w in done:
                if w.future.done():
                    continue
                if w.error is not None and not step.in_backward:
                    w.future.set_exception(w.error)
                else:
                    w.future.set_result(w.flat)

    def _start_step(self, step: _Step) -> None:
        """Follow the scaler's scale; after a checkpoint, take the layout decisions of the step before it."""
        if step.scale is not None:  # residuals and carried results are in the scaler's units
            self._memory.rescale(self._memory.scale.moved_to(step.scale), self.layout_states.values())
        if self._resumed and self._layouts.orders_last:
            step.pretend = True
            for order in self._layouts.orders_last:
                if self._layouts.decide(order, adopt=True) == "new":
                    self._new_layout(order, step, 0, None, [])
                elif order not in self._layouts.held:
                    step.staged.append(order)
                step.orders.append(order)
        self._resumed = False

    def _take(self, step: _Step, bucket: _Waiting, index: int, comm: Communicator, done: List[_Waiting]) -> None:
        order, flat = bucket.order, bucket.flat
        if sum(self._numel[i] for i in order) != flat.numel():
            # Not exactly its parameters (never seen from DDP): reduced as DDP laid it out.
            self._reduce(step, order, flat, index, comm, done, staged=False, hold=False)
            return
        how = self._layouts.decide(order, adopt=not step.pretend)
        if not step.pretend:
            step.orders.append(order)
            if how == "staged":
                step.staged.append(order)
        if how == "new":
            self._new_layout(order, step, index, comm, done)
        if how != "staged":
            self._reduce(step, order, flat, index, comm, done, staged=False)
            return
        starts, touched = self._layouts.starts(order), []
        for i in order:
            key = self._layouts.holder[i]
            buf = self._layouts.buffer(key, flat)
            at, n = self._layouts.starts(key)[i], self._numel[i]
            buf[at:at + n].copy_(flat[starts[i]:starts[i] + n])
            arrived = step.arrived.setdefault(key, set())
            if not arrived:
                touched.append(key)
            arrived.add(i)
        for key in touched:
            if len(step.arrived[key]) == len(key):
                del step.arrived[key]
                self._reduce(step, key, self._layouts.buffers[key], index, comm, done, staged=True)

    def _new_layout(self, order: Layout, step: _Step, index: int, comm: Optional[Communicator],
                    done: List[_Waiting]) -> None:
        """Hold ``order`` as a layout, dropping the held layouts it overlaps (their residuals wait
        per parameter); one with parameters staged this step reduces those first (:meth:`_flush`)."""
        for key in {self._layouts.holder[i]: None for i in order if i in self._layouts.holder}:
            if key in step.arrived:
                self._flush(step, key, index, comm, done)
        for key in {self._layouts.holder[i]: None for i in order if i in self._layouts.holder}:
            self._layouts.drop(key, self._memory)
        self._layouts.hold(order)

    def _flush(self, step: _Step, key: Layout, index: int, comm: Communicator, done: List[_Waiting]) -> None:
        """Held layout ``key`` will not complete this step: reduce its staged parameters, per
        waiting bucket in that bucket's order, as layouts of their own."""
        del step.arrived[key]
        parts = [(w, tuple(i for i in w.order if i in w.remaining and self._layouts.holder.get(i) == key))
                 for w in step.waiting]
        for w, part in parts:
            if not part:
                continue
            self._new_layout(part, step, index, comm, done)
            starts = self._layouts.starts(w.order)
            buf = w.flat if part == w.order else torch.cat(
                [w.flat[starts[i]:starts[i] + self._numel[i]] for i in part])
            self._reduce(step, part, buf, index, comm, done, staged=part != w.order)

    def _reduce(self, step: _Step, key: Layout, buf: torch.Tensor, index: int, comm: Communicator,
                done: List[_Waiting], staged: bool, hold: bool = True) -> None:
        """Reduce layout ``key`` in ``buf`` (in place), then hand the result to the waiting buckets.

        1. Warm-up steps and small layouts: dense allreduce. Otherwise the layout's
           state (its algorithm, error feedback, compressor).
        2. Refused (InputError, on every rank): with a scaler and NaN/Inf, the result
           is Inf; otherwise zeros, and the step's error is this one. The step is refused.
        3. Went through: add the carried results of its parameters.
        4. Copy the result into every waiting bucket that holds its parameters; a bucket
           none of whose parameters wait any more is done.
        """
        t0 = time.perf_counter()
        before = comm.stats.snapshot()
        dense = self.step < self.warmup_steps or buf.numel() < self.min_bucket_elements
        error, selected, refused, owed = None, 0, False, []
        try:
            st = None if dense else self._layouts.state(key, self._memory, self.comm, buf.device, buf.dtype)
            if st is None or not st.error_feedback:  # a call without a residual of its own sends them
                owed = self._memory.owed(key, self._layouts.sizes(key), buf)
            if st is None:
                allreduce(buf, algorithm="dense", op=self.op, comm=comm, out=buf)
                selected = buf.numel()
            else:
                allreduce(buf, state=st, op=self.op, compressor=self.compressor, comm=comm, out=buf)
                selected = st.last.global_selected
        except InputError as exc:
            step.refused = refused = True
            if self.scaler is not None and isinstance(exc, NonFiniteError):
                buf.fill_(float("inf"))  # what GradScaler looks for: it skips the step on every rank
            else:
                buf.zero_()
                error = exc
                step.error = step.error or exc
        else:
            self._memory.settle(owed)
            if hold:
                starts = self._layouts.starts(key)
                for i in key:
                    carried = self._memory.carry.take(i)
                    if carried is not None:
                        buf[starts[i]:starts[i] + self._numel[i]] += carried.to(buf.dtype)
                step.results.append((key, buf))
        delta = comm.stats - before
        self.stats[-1].append({"bucket": index, "layout": key, "numel": buf.numel(), "dense": dense,
                               "selected": selected, "bytes_sent": delta.bytes_sent,
                               "messages": delta.messages_sent, "seconds": time.perf_counter() - t0,
                               "staged": staged, "refused": refused})
        self.totals["bytes_sent"] += delta.bytes_sent
        self.totals["dense_buckets" if dense else "sparse_buckets"] += 1
        params, starts = set(key), self._layouts.starts(key)
        for w in list(step.waiting):
            common = w.remaining & params
            if not common:
                continue
            if w.flat is not buf:
                at = self._layouts.starts(w.order)
                for i in common:
                    n = self._numel[i]
                    w.flat[at[i]:at[i] + n].copy_(buf[starts[i]:starts[i] + n])
            w.error = w.error or error
            w.remaining -= common
            if not w.remaining:
                step.waiting.remove(w)
                done.append(w)

    def _end_step(self, step: _Step, index: int, comm: Communicator, done: List[_Waiting]) -> None:
        """After the step's last bucket: flush incomplete layouts, carry a refused step's results,
        remember the orders for the layout rules, count the step."""
        for key in list(step.arrived):
            if key in step.arrived:
                self._flush(step, key, index, comm, done)
        if step.refused:
            for key, buf in step.results:
                self._memory.carry.keep_flat(key, self._layouts.sizes(key), buf)
            self.totals["refused_steps"] += 1
        step.results = []
        self._layouts.staged_last, self._layouts.orders_last = step.staged, step.orders
        self.step += 1
        self.totals["steps"] += 1
        self.stats.append([])
        if len(self.stats) > 1000:  # keep memory bounded on long runs
            del self.stats[:-1000]
        step.ended = True


def _upgrade_pickled(d: dict) -> dict:
    """The attributes of a :class:`SparseHookState` pickled by an earlier version, as they are now."""
    d = dict(d)
    if "buckets" in d:  # before the layouts' states had their own name
        d["layout_states"] = d.pop("buckets")
    if "_memory" not in d:  # before the gradient memory was one object
        maker = StateMaker(d["algorithm"], d["density"], d["algorithm_options"], d["error_feedback"],
                           d["compressor"], d.get("network"), dense_keeps_residual=False)
        d["_memory"] = memory = GradientMemory(maker)
        memory.parked, memory.carry.values = d.pop("_pending", {}), d.pop("_carried", {})
        memory.scale.value = d.pop("_scale", None)
        d.pop("spec", None)
    if not isinstance(d.get("_layouts"), Layouts):  # before the layouts were one object
        layouts = Layouts(d["_numel"])
        layouts.states = d.pop("layout_states", {})
        for key in d.pop("_layouts", None) or list(layouts.states):  # before layouts were held: its states'
            layouts.hold(key)
        layouts.staged_last, layouts.orders_last = d.pop("_staged_last", []), d.pop("_orders_last", None)
        for name in ("_holder", "_canonical", "_starts_cache", "_reordered"):
            d.pop(name, None)
        d["_layouts"] = layouts
    for name in ("_resumed", "scaler", "_calling", "_live", "_broken"):
        d.setdefault(name, False if name == "_resumed" else None)
    d["totals"].setdefault("refused_steps", 0)
    return d


def sparse_allreduce_hook(state: SparseHookState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: sparse (or warm-up/small-layout dense) allreduce of a bucket.

    1. On the caller's thread: the step's first bucket reads the scaler's scale and
       arranges for the step's error to be raised when backward ends.
    2. Synchronously, or with ``overlap=True`` as a job on the state's engine (in
       bucket order): reduce the bucket in place if it is a held layout, else stage it
       into the held layouts and reduce each once all its parameters came, or make it
       a layout (see the module docstring); refusals and carried results as there.
    3. Return a future of the bucket's result (averaged for "avg"), in the bucket's own
       buffer: complete once all its parameters are reduced.
    """
    order = tuple(state._param_index[id(p)] for p in bucket.parameters())
    flat, index, last = bucket.buffer(), bucket.index(), bucket.is_last()
    step = state._open_call(index, last)
    future: torch.futures.Future = torch.futures.Future()
    if state._engine is None:
        state._arrive(step, flat, order, index, last, future, state.comm)
        return future
    job = state._engine.run(lambda comm: state._arrive(step, flat, order, index, last, future, comm),
                            what=f"DDP bucket {index}")

    def not_run(job_future: torch.futures.Future) -> None:
        # The engine refused the job without running it (closed, or the interpreter exits):
        # the bucket's future must still complete, or DDP waits for it forever.
        try:
            job_future.wait()
        except BaseException as exc:  # noqa: BLE001 - handed on through the step
            step.error = step.error or exc
            if not future.done():
                if step.in_backward:
                    future.set_result(flat)
                else:
                    future.set_exception(exc)

    job.future.add_done_callback(not_run)
    return future
