"""The ``sparsecomm`` command and its helpers: benchmarks, studies, training runs, reports.

Everything here is built on the library (``sparsecomm.allreduce``, the
communicators, the schedules, the optimizers); nothing in the library imports
it. ``launch.spawn`` starts local gloo ranks for the commands and the tests.
"""

__all__: list[str] = []
