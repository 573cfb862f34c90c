"""Exceptions raised by sparsecomm.

Every error a user can meet derives from :class:`SparseCommError`, so one
``except`` clause catches them all; each also derives from the builtin a Python
programmer would expect (``ValueError`` for bad input, ``TimeoutError`` for a
wait that ran out).
"""

from __future__ import annotations

__all__ = ["SparseCommError", "InputError", "NonFiniteError", "InputFileError", "CommTimeoutError", "PeerError", "ScheduleError"]


class SparseCommError(Exception):
    """Base class of every sparsecomm error."""


class InputError(SparseCommError, ValueError):
    """The arguments of a call are invalid on this or on another rank.

    Raised on *every* rank of the group, so that no rank is left waiting in a
    collective for a peer that gave up.
    """


class NonFiniteError(InputError):
    """The tensor (or its sum with the error-feedback residual) holds NaN or Inf on some rank.

    An :class:`InputError` like any other, raised on every rank alike, with the
    state left as it was. Mixed-precision training meets it on purpose: a loss
    scale too high overflows fp16 gradients, and ``GradScaler`` must then skip
    the step on every rank; the hook and the schedules, given ``scaler=``,
    catch this error and hand the scaler an Inf instead (see docs/guarantees.md).

    Attributes:
        ranks: the ranks whose tensor (or sum) was not finite.
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)

    def __reduce__(self):  # picklable across processes with its ranks
        return (type(self), (self.args[0], self.ranks))


class InputFileError(SparseCommError, ValueError):
    """A file given to a command cannot be used: missing, unreadable, not JSON, or not what it reads.

    The message starts with the file's path and says in one line what is wrong.
    """


class CommTimeoutError(SparseCommError, TimeoutError):
    """A blocking wait ran out of time; the message names the operation and peer."""


class PeerError(SparseCommError):
    """Another rank failed or went away, so this rank cannot go on.

    In the simulated world: a peer raised. On torch.distributed: the
    transport reported a broken connection (a peer exited) before the timeout.
    """


class ScheduleError(SparseCommError, RuntimeError):
    """A schedule was driven in a way it cannot honour without losing gradient.

    Its reductions start during backward, so a second backward before
    ``step()`` (gradient accumulation), or an in-place change of the gradients
    after backward and before the schedule waits for them (``synchronize()``,
    or ``step()`` which calls it; ``clip_grad_norm_``, ``GradScaler.unscale_``),
    would be left out of what is reduced. Raised on the rank that did it, once
    the step's collective calls are made; the message says what to do instead.
    """
