"""Positions of segments laid end to end, in one array operation."""

from __future__ import annotations

import numpy as np
import torch

from sparsecomm.segments import positions, starts_of


def test_positions_walk_every_segment_in_order():
    starts, lengths = np.array([10, 0, 7, 100]), np.array([3, 0, 2, 1])
    assert starts_of(lengths).tolist() == [0, 3, 3, 5]
    assert positions(starts, lengths).tolist() == [10, 11, 12, 7, 8, 100]
    assert positions(starts, lengths, step=0).tolist() == [10, 10, 10, 7, 7, 100]
    assert positions(starts, lengths, step=4).tolist() == [10, 14, 18, 7, 11, 100]
    assert positions(np.zeros(0), np.zeros(0)).dtype == torch.int64
    assert positions(np.zeros(0), np.zeros(0)).numel() == 0
    assert starts_of(np.zeros(0)).tolist() == []
