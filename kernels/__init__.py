"""Local (single-rank) kernels: top-k selection by magnitude and COO helpers.

Installed as ``sparsecomm.kernels``. Each function here is the torch reference
path, which runs on any device; faster device-specific paths plug in behind the
same functions.
"""

from .coo import (index_dtype_for, pack_records, record_bytes, scatter_add,
                  split_by_boundaries, unpack_records)
from .select import kth_largest, select_above, topk_indexes, topk_of_candidates

__all__ = ["kth_largest", "topk_indexes", "select_above", "topk_of_candidates",
           "split_by_boundaries", "pack_records", "unpack_records", "record_bytes",
           "index_dtype_for", "scatter_add"]
