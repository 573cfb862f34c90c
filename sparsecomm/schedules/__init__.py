"""Communication schedules that overlap sparsecomm allreduces with computation (issue 12).

* :mod:`.planner`: MG-WFBP's merge plan (exact, and the paper's Algorithm 1).
"""

from .planner import METHODS, fit_linear, plan_merge, plan_time

__all__ = ["plan_merge", "plan_time", "fit_linear", "METHODS"]
