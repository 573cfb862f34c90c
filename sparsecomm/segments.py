"""Index arithmetic over segments laid end to end (messages in a buffer, parts of a selection).

A phase of a sparse allreduce moves P parts at once; working on them one at a time costs a
Python call per part, thousands at P = 1024. These two functions give every position of
every segment in one array operation instead.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["starts_of", "positions"]


def starts_of(lengths: np.ndarray) -> np.ndarray:
    """Where each of segments of these ``lengths`` begins when they lie end to end (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    return np.cumsum(lengths, dtype=np.int64) - lengths


def positions(starts: np.ndarray, lengths: np.ndarray, step: int = 1,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """``starts[m] + step * i`` for every ``i < lengths[m]``, segment after segment (int64).

    ``step=0`` repeats each segment's start (a value per entry of its segment).
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    total = int(lengths.sum())
    first = torch.from_numpy(np.ascontiguousarray(np.asarray(starts, dtype=np.int64).reshape(-1)
                                                  - step * starts_of(lengths)))
    out = torch.repeat_interleave(first, torch.from_numpy(lengths), output_size=total)
    if step:
        out += torch.arange(total) * step
    return out.to(device)
