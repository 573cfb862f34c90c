"""Communication schedules that overlap sparsecomm allreduces with computation.

* :mod:`.base`: the :class:`Schedule` interface every schedule implements, and the
  training-loop rules they share (carried results, the loss scale, checkpoints).
* :mod:`.engine`: an asynchronous engine, jobs in submission order on a
  communication thread over a duplicate of the caller's communicator.
* :mod:`.planner`: MG-WFBP's merge plan (exact, and the paper's Algorithm 1).
* :mod:`.groups`: the group schedules' base, WFBP and SyncEASGD, around a model and any optimizer.
* :mod:`.mgwfbp`: MG-WFBP, the groups of a merge plan profiled and fitted online.
* :mod:`.pipesgd`: Pipe-SGD, each step's allreduce overlapping the next step.
* :mod:`.dear`: DeAR, the second half of each group's allreduce and its update in the next forward.
"""

from .base import Schedule
from .dear import DeAR
from .engine import Engine, Job
from .groups import WFBP, GroupSchedule, SyncEASGD
from .mgwfbp import MGWFBP
from .pipesgd import PipeSGD
from .planner import METHODS, fit_linear, plan_merge, plan_time

#: Every schedule by name: what ``sparsecomm train --schedule``, the tests and benchmarks read.
SCHEDULES: dict[str, type[Schedule]] = {"wfbp": WFBP, "synceasgd": SyncEASGD, "mgwfbp": MGWFBP, "dear": DeAR,
                                         "pipesgd": PipeSGD}

__all__ = ["Engine", "Job", "plan_merge", "plan_time", "fit_linear", "METHODS", "Schedule", "SCHEDULES",
           "GroupSchedule", "WFBP", "SyncEASGD", "MGWFBP", "PipeSGD", "DeAR"]
