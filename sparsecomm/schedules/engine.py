"""An asynchronous engine: sparsecomm allreduces run on a communication thread, in submission order.

    engine = sparsecomm.schedules.Engine()              # collective: every rank, same order
    job = engine.submit(grad, state=state, op="avg")     # returns at once
    ...                                                  # compute meanwhile
    reduced = job.wait()                                 # the allreduce's result (or its error)

The engine owns a duplicate of the caller's communicator (``Communicator.dup``:
``dist.new_group`` over the same ranks, ``MPI_Comm_dup``, a channel of its own
in the simulated world), so its collectives never race the caller's or DDP's.
Every rank must submit the same jobs in the same order, as for any collective.

Errors raised on the thread (``InputError``, ``CommTimeoutError``, ...) are
re-raised, the same object, by the job's ``wait()``. An input error is raised
on every rank alike and the engine goes on; any other error (a timeout, a
dead peer) leaves the ranks out of step, so the engine refuses every later
job with that error instead of hanging.

On CPU the thread's local work (selection, packing) competes with the
caller's computation for cores: torch and numba size their thread pools
per thread, so give the engine a thread budget (``threads=``) that leaves
the caller its own.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Any, Callable

import torch

from ..api import allreduce
from ..comm import Communicator, resolve
from ..errors import CommTimeoutError, InputError, ScheduleError

__all__ = ["Engine", "Job", "write_grads", "point_grads", "grads_in", "grad_versions", "grads_changed",
           "second_backward", "at_backward_end"]


def write_grads(params: "list[torch.nn.Parameter]", flat: torch.Tensor) -> None:
    """Copy ``flat`` (the params' gradients one after another) into their ``.grad``
    (created where None): what every schedule does with a reduced group."""
    offset = 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def point_grads(params: "list[torch.nn.Parameter]", flat: torch.Tensor) -> bool:
    """Make each param's ``.grad`` its view of ``flat`` (laid out as :func:`write_grads` reads it):
    the same gradients as copying them, without a pass over n. False, with nothing changed,
    where a view cannot be a ``.grad`` (another dtype or device than a param's)."""
    if any(p.dtype != flat.dtype or p.device != flat.device for p in params):
        return False
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return True


def grads_in(params: "list[torch.nn.Parameter]", flat: torch.Tensor) -> bool:
    """Whether every param's ``.grad`` is its view of ``flat`` (as :func:`point_grads` left it,
    and a backward since accumulated into it in place): then ``flat`` holds the gradients."""
    offset, base, size = 0, flat.data_ptr(), flat.element_size()
    for p in params:
        g = p.grad
        if (g is None or g.dtype != flat.dtype or g.device != flat.device or g.shape != p.shape
                or not g.is_contiguous() or g.data_ptr() != base + offset * size):
            return False
        offset += p.numel()
    return True


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now running ends (call it from a hook inside it),
    as DDP finalises its reduction."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def grad_versions(params: "list[torch.nn.Parameter]") -> list:
    """Each param's ``.grad`` and its version counter, taken at the end of backward (see
    :func:`at_backward_end`), for :func:`grads_changed` at ``step()``.

    Not when a group is read: views of one buffer share one counter, so a
    backward accumulating into another group's views of it (a user's flat
    gradient buffer; this schedule's own after a regrouping) would count as a
    change."""
    return [(p.grad, None if p.grad is None else p.grad._version) for p in params]


def grads_changed(params: "list[torch.nn.Parameter]", seen: list, what: str, instead: str) -> ScheduleError | None:
    """The :class:`ScheduleError` to raise where a ``.grad`` was replaced or changed in place since
    :func:`grad_versions` (torch bumps a tensor's version on every in-place op): the schedule
    reduced the old values, and the change would silently be lost. None if nothing changed."""
    for i, (p, (g, version)) in enumerate(zip(params, seen)):
        if p.grad is not g or (g is not None and g._version != version):
            return ScheduleError(
                f"{what}: the gradient of a parameter (shape {tuple(p.shape)}, #{i} of its group) changed "
                "between backward and step() (an in-place change such as clip_grad_norm_ or "
                "GradScaler.unscale_, zero_grad, or a new .grad). Its allreduce had already started "
                f"in backward from the old values, so the change would be lost (or race the allreduce "
                f"reading them). {instead}")
    return None


def second_backward(what: str) -> ScheduleError:
    """The error of a gradient arriving twice before ``step()`` (gradient accumulation)."""
    return ScheduleError(
        f"{what}: a second backward before step(). Each group's allreduce starts as soon as its "
        "gradients are ready, so gradients accumulated over several backward passes would be left "
        "out. Call step() after every backward, or use PipeSGD, which reduces what step() finds.")


class _Future(torch.futures.Future):
    """A job's ``torch.futures.Future`` whose ``wait()`` lets the simulated world's other ranks run
    meanwhile, as :meth:`Job.wait` does (a plain wait kept this rank's turn, so the job's peers
    could not run and the wait lasted the whole timeout)."""

    def __init__(self, idle: Callable[[], Any]) -> None:
        super().__init__()
        self._idle = idle

    def wait(self) -> Any:
        with self._idle():
            return super().wait()


class Job:
    """A submitted allreduce: ``wait()`` returns its result or raises its error.

    ``future`` is the same result as a ``torch.futures.Future`` (what a DDP
    communication hook returns). ``seconds``: how long the job ran on the
    communication thread, once done (queueing excluded).
    """

    def __init__(self, name: str, idle: Callable[[], Any], timeout: float) -> None:
        self.name = name
        self.future: torch.futures.Future = _Future(idle)
        self._done = threading.Event()
        self._idle, self._timeout = idle, timeout
        self._result: Any = None
        self._error: BaseException | None = None
        self.seconds: float | None = None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        if error is None:
            self.future.set_result(result)
        else:
            self.future.set_exception(error)
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """The result; raises what the job raised, or CommTimeoutError after ``timeout`` seconds
        (default: the communicator's timeout and a margin, so the job's own waits time out first)."""
        with self._idle():  # the simulated world lets the other ranks run meanwhile
            finished = self._done.wait(self._timeout if timeout is None else timeout)
        if not finished:
            raise CommTimeoutError(f"sparsecomm engine: {self.name} did not finish within "
                                   f"{self._timeout if timeout is None else timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._result


_STOP = object()
_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()


#: Seconds the interpreter's exit waits, for all live engines together, for their running jobs.
EXIT_GRACE = 10.0


@atexit.register
def _stop_engines_at_exit() -> None:
    """Stop every live engine before the interpreter finalises.

    A daemon thread still inside torch or numba code at that point is ended by
    a forced unwind, which torch's noexcept C++ frames turn into
    ``std::terminate``: a program that returned while a job was running
    aborted with exit code 134. So queued jobs are dropped (they fail) and the
    running ones may end, all within EXIT_GRACE seconds: a job blocked on a
    peer that already dropped its share is not waited for to its timeout
    (the peers see this rank's exit that much later).
    """
    deadline = time.monotonic() + EXIT_GRACE
    engines = list(_LIVE)
    for engine in engines:
        engine._drop_queued()
    for engine in engines:
        engine._thread.join(max(0.0, deadline - time.monotonic()))


class Engine:
    """Runs sparsecomm allreduces submitted by this rank on one communication thread.

    1. At construction, duplicate the communicator (collective).
    2. ``submit`` queues a job and returns a :class:`Job` at once.
    3. The thread takes jobs in order and runs each as
       ``sparsecomm.allreduce(tensor, comm=<duplicate>, **options)``; the
       result (or the exception) completes the job.
    4. After an error other than ``InputError`` the engine is broken: every
       queued and later job fails with that error.
    5. When the interpreter exits, queued jobs are dropped and running ones get
       up to ``EXIT_GRACE`` seconds to end (see ``_stop_engines_at_exit``);
       ``close()`` first if every job must complete.

    Args:
        group, comm: the ranks, as for :func:`sparsecomm.allreduce`.
        threads: torch (and numba) threads the communication thread uses for
            its local work (default 1).
        name: the thread's name, for debuggers and error messages.
    """

    def __init__(self, group: Any = None, comm: Any = None, *, threads: int = 1,
                 name: str = "sparsecomm-engine") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self._user: Communicator = resolve(group, comm)
        self.comm: Communicator = self._user.dup()
        self.threads, self.name = threads, name
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._broken: BaseException | None = None
        self._submitted = 0
        self._thread = threading.Thread(target=self._serve, name=f"{name}-rank-{self.comm.rank}", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def submit(self, tensor: torch.Tensor, **options: Any) -> Job:
        """Queue ``sparsecomm.allreduce(tensor, **options)``; ``tensor`` must stay unchanged until
        the job is done (``out=`` may name where the result goes)."""
        if "comm" in options or "group" in options:
            raise InputError("Engine.submit: the engine runs on its own communicator; "
                             "pass group=/comm= to Engine() instead")
        return self.run(lambda comm: allreduce(tensor, comm=comm, **options),
                        what=f"allreduce of {tuple(tensor.shape)} {tensor.dtype}")

    def run(self, fn: Callable[[Communicator], Any], what: str = "a call") -> Job:
        """Queue ``fn(comm)`` (any sparsecomm calls on the engine's communicator ``comm``); its
        return value is the job's result. Every rank must queue the same collectives in the
        same order."""
        self._submitted += 1
        job = Job(f"job {self._submitted} ({what})", self._user.idle, self.comm.timeout + 5.0)
        if self._broken is not None:
            job._finish(error=self._broken)
            return job
        if not self._thread.is_alive():
            job._finish(error=RuntimeError("sparsecomm engine: closed"))
            return job
        self._queue.put((job, fn))
        return job

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            with self._user.idle():
                self._thread.join(self.comm.timeout + 5.0)

    def _drop_queued(self) -> None:
        """At exit: fail the queued jobs and ask the thread to stop after the running one."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0]._finish(error=RuntimeError("sparsecomm engine: the interpreter is exiting"))
        self._queue.put(_STOP)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _serve(self) -> None:
        torch.set_num_threads(self.threads)  # per thread: the caller keeps its own budget
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, fn = item
            if self._broken is not None:
                job._finish(error=self._broken)
                continue
            t0 = time.perf_counter()
            try:
                result = fn(self.comm)
            except InputError as exc:  # raised alike on every rank: the ranks stay in step
                job.seconds = time.perf_counter() - t0
                job._finish(error=exc)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by Job.wait
                self._broken = exc
                job._finish(error=exc)
            else:
                job.seconds = time.perf_counter() - t0
                job._finish(result)
