"""An emulated slow-link cluster on one machine: ``sparsecomm emulate``.

``run(P, "1gbit", ["python", "my_rank.py"], timeout=600)`` makes P network
namespaces ``sc0 .. sc{P-1}``, each with one veth port ``scv{r}`` (address
``10.77.0.{r+1}/24``) to a bridge that lives in its own namespace ``scsw``,
shapes both directions of every port to the rate with ``tbf`` (a rank's
injection and ejection bandwidth, as behind a non-blocking switch), starts one
process per rank inside its namespace with the usual torch.distributed
variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...), waits for them and
always removes the namespaces again. It needs root and iproute2; no latency is
added (``netem`` is not available everywhere ``tbf`` is). With ``mpi=True``
(``--mpi``) the ranks are instead one MPICH ``mpiexec`` job whose rank r runs
in namespace r and talks TCP over its shaped port.

From the command line (wired in ``sparsecomm.tools.cli``)::

    sparsecomm emulate --ranks 4 --rate 1gbit -- python -m pytest benchmarks/test_allreduce.py

With ``--ranks-per-node G`` (``ranks_per_node=``) the cluster is P/G nodes: a namespace and
one shaped port each, whose G ranks reach each other over the namespace's loopback (on this
machine's cores, so its "fast fabric" is only as fast as they are), with ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` set as torchrun sets them.

Every rank sees ``SPARSECOMM_LAUNCHER=emulate`` and
``SPARSECOMM_NETWORK="emulated 1gbit tbf, P=4"``, which the benchmarks record
in their JSON so a result says which network it was measured on.
"""

from .command import add_arguments, main
from .netns import (EXIT_PRECONDITION, EXIT_TIMEOUT, MAX_RANKS, SUBNET, EmulateError, cluster, down, network_label,
                    preflight, tc_rate, up)
from .ranks import run

__all__ = ["EmulateError", "preflight", "tc_rate", "up", "down", "cluster", "run", "network_label",
           "add_arguments", "main", "MAX_RANKS", "SUBNET", "EXIT_PRECONDITION", "EXIT_TIMEOUT"]
