"""Local (single-rank) kernels: top-k selection by magnitude, fused select, COO and payload helpers.

How it is imported: this folder sits at the top of the repository but is
installed *inside* the package as ``sparsecomm.kernels`` (``package-dir`` in
pyproject.toml maps the name to this folder in wheels and editable installs),
and the symbolic link ``sparsecomm/kernels -> ../kernels`` shows the same
mapping to type checkers, editors and a checkout on ``sys.path``. Import it as
``sparsecomm.kernels``; modules inside it import each other relatively, and
the package as ``..``. Every operation with fast paths
(``kth_largest``, ``select_above``, ``ef_select``, ``ef_accumulate``, ``count_above``, ``bucketize``,
``scatter_add``, ``topk_of_candidates``, ``pack_records``/``unpack_records``,
``pack_message``/``unpack_message``, ``isin_sorted``,
``union_sorted_runs``, ``sum_sorted_runs``, ``take_and_zero``, ``scatter_dense``, ``nonzero``,
``encode_codes``/``decode_codes``) has one table, a ``dispatch.KernelOp``
declared next to its torch reference: backend -> implementation, and the rule
under which a backend hands a call to the reference. ``dispatch`` picks the
torch reference, Triton, CuPy or numba (CPU) path for the tensor's device;
``backend=`` and the environment variable ``SPARSECOMM_KERNELS`` override the
choice (rules in ``kernels.dispatch``). Optional libraries (triton, cupy,
numba) are imported only when a path that needs them runs.

Layout, one concern per module:

* operations and their torch references: ``select`` (k-th largest, top-k,
  threshold selection), ``efselect``, ``estimate``, ``coo``, ``message``, ``payload``;
  ``radix`` is the digit choice the Triton and CuPy radix selects share.
* ``dispatch``: the backend rules and ``KernelOp``.
* one pair of modules per library, named alike: ``<library>_backend`` holds
  the launchers, one function per operation named after it, with the
  operation's signature (what the tables name); ``_<library>_jit`` holds the
  kernel bodies the library compiles just in time (numba ``@njit`` loops,
  ``@triton.jit`` kernels, CUDA C source for CuPy's NVRTC):
  ``numba_backend`` + ``_numba_jit`` (the ``cpu`` backend; a package, one
  module per operation),
  ``triton_backend`` + ``_triton_jit``, ``cupy_backend`` + ``_cupy_jit``.

Imports run one way: backend modules may use the operation modules' helpers,
operation modules name backends only as strings in their tables.
"""

from .coo import (
                  index_dtype_for,
                  isin_sorted,
                  pack_records,
                  record_bytes,
                  scatter_add,
                  scatter_dense,
                  split_by_boundaries,
                  sum_sorted_runs,
                  take_and_zero,
                  union_sorted_runs,
                  unique_indexes,
                  unpack_records,
)
from .dispatch import BackendUnavailable
from .efselect import Selected, ef_accumulate, ef_select, ef_select_counted, shares_memory, tally
from .estimate import bucketize, count_above, count_on_device, estimate_threshold
from .message import (
                  blocked,
                  message_bytes,
                  messages_bytes,
                  pack_message,
                  pack_messages,
                  unpack_message,
                  unpack_messages,
)
from .payload import (
                  cast_values,
                  decode_codes,
                  delta_decode,
                  delta_encode,
                  dequantize,
                  encode_codes,
                  pack_unsigned,
                  quantize,
                  unpack_unsigned,
)
from .select import kth_largest, nonzero, select_above, topk_indexes, topk_of_candidates

__all__ = ["kth_largest", "topk_indexes", "select_above", "topk_of_candidates", "nonzero",
           "split_by_boundaries", "pack_records", "unpack_records", "record_bytes",
           "index_dtype_for", "pack_message", "pack_messages", "unpack_message", "unpack_messages", "message_bytes",
           "messages_bytes", "blocked",
           "scatter_add", "isin_sorted", "unique_indexes", "union_sorted_runs",
           "take_and_zero", "scatter_dense", "sum_sorted_runs", "ef_select", "ef_select_counted", "Selected", "tally",
           "ef_accumulate", "shares_memory",
           "estimate_threshold", "count_above", "count_on_device", "bucketize",
           "BackendUnavailable", "cast_values", "quantize", "dequantize", "delta_encode",
           "delta_decode", "encode_codes", "decode_codes", "pack_unsigned", "unpack_unsigned"]
