"""The training tasks (tools/tasks.py): disjoint per-rank batches, seeded models, their metric."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from sparsecomm.tools.tasks import OPTIMIZERS, TASKS, get_task


def test_an_unknown_task_or_optimizer_is_named():
    with pytest.raises(ValueError, match="unknown"):
        get_task("imagenet")
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        get_task("digits").optimizer(torch.nn.Linear(2, 2).parameters(), 0.1, "lion")
    assert set(TASKS) == {"digits", "lm"} and OPTIMIZERS == ("sgd", "adamw")


def test_digits_ranks_see_disjoint_batches_of_the_promised_count():
    task = get_task("digits")
    size, batch = 3, 16
    seen = []
    for rank in range(size):
        batches = list(task.batches(rank, size, batch, epoch=0))
        assert len(batches) == task.steps_per_epoch(size, batch)
        assert all(x.shape == (batch, 64) and y.shape == (batch,) for x, y in batches)
        seen.append({tuple(x_row.tolist()) for x, _ in batches for x_row in x})
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2])


def test_models_are_seeded_and_the_metric_is_a_fraction():
    task = get_task("digits")
    a, b = task.model(seed=1), task.model(seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert 0.0 <= task.evaluate(a) <= 1.0


def test_the_language_model_task():
    task = get_task("lm")
    model = task.model()
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    x, y = next(iter(task.batches(0, 4, 2, epoch=0)))
    assert x.shape == y.shape and torch.equal(x[:, 1:], y[:, :-1])  # next-byte targets
    assert task.metric == "val_loss" and not task.higher_is_better


def test_digits_are_scikit_learns_read_without_importing_it():
    # The training ranks read the file scikit-learn ships (importing it cost each rank 1.1 s).
    sklearn = pytest.importorskip("sklearn.datasets")
    from sparsecomm.tools.tasks import _load_digits

    data, target = _load_digits()
    want = sklearn.load_digits()
    assert np.array_equal(data, want.data) and np.array_equal(target, want.target)
    probe = "import sys; from sparsecomm.tools.tasks import DigitsTask; DigitsTask(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
