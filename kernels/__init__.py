"""Local (single-rank) kernels: top-k selection by magnitude, fused select, COO and payload helpers.

Installed as ``sparsecomm.kernels``. Every operation with fast paths has one
dispatcher (``kth_largest``, ``ef_select``, ``estimate_threshold``) that picks
the torch reference, Triton, CuPy or numba (CPU) path for the tensor's device;
``backend=`` and the environment variable ``SPARSECOMM_KERNELS`` override the
choice (rules in ``kernels.dispatch``). Optional libraries (triton, cupy,
numba) are imported only when a path that needs them runs.
"""

from .coo import (index_dtype_for, isin_sorted, pack_records, record_bytes, scatter_add,
                  split_by_boundaries, unique_indexes, unpack_records)
from .dispatch import BackendUnavailable
from .efselect import ef_select
from .estimate import count_above, estimate_threshold
from .payload import (cast_values, decode_codes, delta_decode, delta_encode, dequantize, encode_codes,
                      pack_unsigned, quantize, unpack_unsigned)
from .select import kth_largest, select_above, topk_indexes, topk_of_candidates

__all__ = ["kth_largest", "topk_indexes", "select_above", "topk_of_candidates",
           "split_by_boundaries", "pack_records", "unpack_records", "record_bytes",
           "index_dtype_for", "scatter_add", "isin_sorted", "unique_indexes", "ef_select",
           "estimate_threshold", "count_above",
           "BackendUnavailable", "cast_values", "quantize", "dequantize", "delta_encode",
           "delta_decode", "encode_codes", "decode_codes", "pack_unsigned", "unpack_unsigned"]
