"""numba-compiled CPU loops behind ``kernels.numba_backend`` (imports numba at import time).

Only ``kernels.numba_backend`` imports this module, inside its functions, so
that ``sparsecomm.kernels`` itself never needs numba.

Why numba: the CPU fast paths are single passes over memory with a rare,
data-dependent branch (select, collect a candidate, bump a count). torch and
numpy can only express these as chains of full-size temporaries (abs, compare,
nonzero, gather), each its own pass; a compiled loop reads each element once.
numba is a pure pip install (llvmlite wheels), needs no compiler on the
machine, and caches the compiled code on disk (``cache=True``) so only the
first process pays the compile.

Why serial kernels over spans, run on threads by ``kernels.numba_backend``:
the same loops inside numba's ``prange`` ran 1.8x slower even on one thread
(the plain add took 27 ms against 17 ms serial at 25M) and numba's thread
pool fought with torch's and with the simulated world's rank threads. Every
function here is ``nogil`` and works on one contiguous span, so
``kernels.numba_backend`` splits a tensor into a few spans per thread and
runs them on the calling thread plus a plain Python thread pool.
"""

from __future__ import annotations

from ._base import BLOCK, chunk_bounds  # first: it sets numba's thread count, then imports numba
from .efselect import ef_select_span, ef_add_span, ef_accumulate_span, tally_span
from .select import select_span, bracket_span, count_above_span, bucket_span
from .codes import encode_codes_span, decode_codes_span
from .merge import merge_runs, merge_sum, member_mask, take_and_zero, is_strictly_increasing, densify_span
from .radix import radix_kth, keep_above
from .scatter import put_at, add_at
from .message import pack_blocked, unpack_blocked, pack_messages, unpack_messages

__all__ = ["ef_select_span", "ef_add_span", "ef_accumulate_span", "tally_span", "select_span", "bracket_span",
           "count_above_span", "encode_codes_span", "decode_codes_span", "merge_runs", "merge_sum",
           "member_mask", "take_and_zero", "is_strictly_increasing", "densify_span", "radix_kth",
           "keep_above", "put_at", "add_at", "bucket_span", "chunk_bounds", "BLOCK", "pack_blocked",
           "unpack_blocked", "pack_messages", "unpack_messages"]
