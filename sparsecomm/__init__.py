"""sparsecomm: gradient compression for data-parallel training, centred on a sparse allreduce.

Entry points::

    sparsecomm.allreduce(tensor, density=0.01)        # Ok-Topk by default
    sparsecomm.sparse_allreduce(tensor, density=0.01)  # the sparse result and stats
    sparsecomm.algorithms()                            # registered algorithm names
    sparsecomm.simulate(P, fn)                         # P virtual ranks in one process
"""

from . import algorithms as _algorithms  # noqa: F401  (registers the algorithms)
from . import baselines as _baselines  # noqa: F401  (registers the baselines)
from .algorithms import GaussiankState, GTopkState, OkTopkState, TopkAState, TopkDSAState
from .api import algorithms, allreduce, sparse_allreduce
from .baselines import DenseState
from .comm import Communicator, SimResult, resolve, simulate
from .errors import CommTimeoutError, InputError, PeerError, SparseCommError
from .network import PROFILES, Network
from .registry import SparseResult
from .state import CallStats, State

__version__ = "0.1.0"

__all__ = ["allreduce", "sparse_allreduce", "algorithms", "simulate", "SimResult",
           "OkTopkState", "TopkAState", "TopkDSAState", "GTopkState", "GaussiankState", "DenseState", "State", "CallStats", "SparseResult",
           "Communicator", "resolve", "Network", "PROFILES",
           "SparseCommError", "InputError", "CommTimeoutError", "PeerError"]
