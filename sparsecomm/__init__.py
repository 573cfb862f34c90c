"""sparsecomm: gradient compression for data-parallel training, centred on a sparse allreduce.

Entry points::

    sparsecomm.allreduce(tensor, density=0.01)        # Ok-Topk by default
    sparsecomm.sparse_allreduce(tensor, density=0.01)  # the sparse result and stats
    sparsecomm.algorithms()                            # registered algorithm names
    sparsecomm.allreduce(tensor, algorithm="auto")     # the one the network model favours
    sparsecomm.allreduce(tensor, algorithm="oktopk2l") # nodes of several GPUs: dense within, sparse between
    sparsecomm.simulate(P, fn)                         # P virtual ranks in one process
"""

try:  # kernels/ and baselines/ live at the top of the checkout; installing (or a link) maps them in
    from . import kernels as _kernels  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - a checkout without symbolic links, not installed
    raise ImportError(
        "sparsecomm.kernels is missing: sparsecomm is imported from a checkout that is not "
        "installed and has no sparsecomm/kernels link. Install it (pip install -e . in the "
        "repository root): kernels/ and baselines/ are installed as sparsecomm.kernels and "
        "sparsecomm.baselines") from exc
from . import algorithms as _algorithms  # noqa: F401  (registers the algorithms)
from . import baselines  # noqa: F401  (sparsecomm.baselines.DenseOverlap)
from .algorithms import (
    DenseState,
    GaussiankState,
    GTopkState,
    OkTopkState,
    OkTopkTwoLevelState,
    TopkAState,
    TopkDSAState,
)
from .api import Pending, algorithms, allreduce, auto_state, begin_allreduce, reduce_scatter, sparse_allreduce
from .choice import choose
from .comm import Communicator, SimResult, resolve, simulate
from .errors import (
    CommTimeoutError,
    InputError,
    NonFiniteError,
    PeerError,
    ScheduleError,
    SparseCommError,
)
from .network import PROFILES, Network, TwoLevel
from .result import SparseResult
from .state import CallStats, State

__version__ = "0.1.0"

__all__ = ["allreduce", "begin_allreduce", "reduce_scatter", "Pending", "sparse_allreduce", "algorithms", "choose", "auto_state",
           "simulate", "SimResult",
           "OkTopkState", "OkTopkTwoLevelState", "TopkAState", "TopkDSAState", "GTopkState", "GaussiankState", "DenseState", "State",
           "CallStats", "SparseResult",
           "Communicator", "resolve", "Network", "TwoLevel", "PROFILES",
           "SparseCommError", "InputError", "NonFiniteError", "CommTimeoutError", "PeerError", "ScheduleError"]
