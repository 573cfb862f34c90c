"""Training tasks for ``sparsecomm train``: real data every machine has, nothing downloaded.

* ``digits``: scikit-learn's bundled handwritten digits (1,797 8x8 images), a
  small MLP (85,002 parameters), SGD with momentum; metric: test accuracy.
* ``lm``: a byte-level transformer language model (about 2.5 million
  parameters) on the Python standard library's own top-level source files
  (``sysconfig.get_paths()["stdlib"]/*.py``, 4-5 MB; every tenth file is held
  out), AdamW; metric: validation loss in nats per byte. The files differ a
  little between Python versions: compare runs made with the same one.

A task gives the model, the optimizer, each rank's batches (every rank its own
shard of the data) and the evaluation. Every rank builds the same model from
the seed.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sysconfig
from typing import Iterator

import numpy as np
import torch

__all__ = ["Task", "DigitsTask", "TextTask", "TASKS", "OPTIMIZERS", "get_task"]


class Task:
    """What :func:`sparsecomm.tools.train.train_rank` trains (see the module docstring)."""

    name = "task"
    #: The evaluation's name, and whether higher is better.
    metric, higher_is_better = "metric", True
    lr = 0.05

    def model(self, seed: int = 0) -> torch.nn.Module:
        raise NotImplementedError

    #: The optimizer it trains with by default ("sgd": SGD with momentum 0.9, or "adamw").
    default_optimizer = "sgd"
    #: AdamW's settings (``torch.optim.AdamW`` and ``sparsecomm.optim.SparseAdamW`` alike).
    adamw_settings = {"betas": (0.9, 0.95), "weight_decay": 0.01}

    def optimizer(self, params, lr: float, kind: str | None = None, momentum: float = 0.9) -> torch.optim.Optimizer:
        kind = kind or self.default_optimizer
        if kind == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=momentum)
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=lr, **self.adamw_settings)
        raise ValueError(f"unknown optimizer {kind!r}; choose from {OPTIMIZERS}")

    def steps_per_epoch(self, size: int, batch: int) -> int:
        raise NotImplementedError

    def batches(self, rank: int, size: int, batch: int, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of one epoch (``steps_per_epoch`` of them)."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model: torch.nn.Module) -> float:
        raise NotImplementedError


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (images, labels), read from the file scikit-learn ships.

    Importing scikit-learn costs each training rank 1.1 s of CPU, for 1,797 rows that
    ``load_digits`` itself reads from ``datasets/data/digits.csv.gz``; the file is located
    without importing the package. ``load_digits`` where the file is not there.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ImportError("the digits task needs scikit-learn (pip install scikit-learn)")
    for root in spec.submodule_search_locations or []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            rows = np.loadtxt(path, delimiter=",")
            return rows[:, :-1], rows[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # optional: only the digits task needs it

    d = load_digits()
    return d.data, d.target


class DigitsTask(Task):
    """scikit-learn's digits, an MLP, SGD with momentum; test accuracy."""

    name, metric, higher_is_better, lr = "digits", "accuracy", True, 0.05

    def __init__(self, seed: int = 0) -> None:
        data, target = _load_digits()
        x = torch.tensor(data, dtype=torch.float32) / 16.0
        y = torch.tensor(target, dtype=torch.int64)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        x, y = x[perm], y[perm]
        cut = int(0.8 * len(x))
        self.train, self.test = (x[:cut], y[:cut]), (x[cut:], y[cut:])

    def model(self, seed: int = 0) -> torch.nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def steps_per_epoch(self, size: int, batch: int) -> int:
        return (len(self.train[0]) // size) // batch

    def batches(self, rank: int, size: int, batch: int, epoch: int):
        per_rank = len(self.train[0]) // size
        xs = self.train[0][rank * per_rank:(rank + 1) * per_rank]
        ys = self.train[1][rank * per_rank:(rank + 1) * per_rank]
        perm = torch.randperm(per_rank, generator=torch.Generator().manual_seed(1000 * epoch + rank))
        for s in range(per_rank // batch):
            idx = perm[s * batch:(s + 1) * batch]
            yield xs[idx], ys[idx]

    def evaluate(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float((model(self.test[0]).argmax(1) == self.test[1]).float().mean())


class _TinyGPT(torch.nn.Module):
    """A decoder-only transformer over bytes: embeddings, pre-norm causal blocks, a tied head."""

    def __init__(self, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(256, width)
        self.pos = torch.nn.Embedding(context, width)
        block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)
        for emb in (self.tok, self.pos):  # small, as GPT-2 does: the tied head starts near uniform
            torch.nn.init.normal_(emb.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(T, device=x.device))
        h = self.norm(self.blocks(h, mask=self.mask[:T, :T], is_causal=True))
        return h @ self.tok.weight.t()  # tied: logits over the 256 byte values


class TextTask(Task):
    """A byte-level transformer LM on the standard library's source; validation loss (nats/byte)."""

    name, metric, higher_is_better, lr = "lm", "val_loss", False, 2e-3
    default_optimizer = "adamw"

    def __init__(self, seed: int = 0, context: int = 128, width: int = 256, layers: int = 3, heads: int = 4,
                 eval_windows: int = 256, root: str | None = None) -> None:
        root = root or sysconfig.get_paths()["stdlib"]
        files = sorted(glob.glob(os.path.join(root, "*.py")))
        if len(files) < 20:
            raise RuntimeError(f"the lm task reads the standard library's sources; found {len(files)} "
                               f"*.py files in {root}")
        train, val = [], []
        for i, path in enumerate(files):
            with open(path, "rb") as f:
                (val if i % 10 == 9 else train).append(f.read())
        self.train_data = torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8).to(torch.int64)
        self.val_data = torch.frombuffer(bytearray(b"".join(val)), dtype=torch.uint8).to(torch.int64)
        self.context, self.width, self.layers, self.heads = context, width, layers, heads
        # Fixed validation windows, evenly spread: every run is scored on the same bytes.
        starts = torch.linspace(0, len(self.val_data) - context - 2, eval_windows).long()
        self.val_x = torch.stack([self.val_data[s:s + context] for s in starts])
        self.val_y = torch.stack([self.val_data[s + 1:s + context + 1] for s in starts])
        self.seed = seed

    def model(self, seed: int = 0) -> torch.nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return _TinyGPT(self.context, self.width, self.layers, self.heads)

    def steps_per_epoch(self, size: int, batch: int) -> int:
        return 50  # an "epoch" is an evaluation period: random windows, no pass over the data

    def batches(self, rank: int, size: int, batch: int, epoch: int):
        # Each rank draws its windows from its own contiguous shard of the training bytes.
        shard = len(self.train_data) // size
        lo = rank * shard
        g = torch.Generator().manual_seed(self.seed * 100_003 + 1009 * epoch + rank)
        for _ in range(self.steps_per_epoch(size, batch)):
            starts = lo + torch.randint(0, shard - self.context - 1, (batch,), generator=g)
            x = torch.stack([self.train_data[s:s + self.context] for s in starts])
            y = torch.stack([self.train_data[s + 1:s + self.context + 1] for s in starts])
            yield x, y

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))

    def evaluate(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            total = 0.0
            for i in range(0, len(self.val_x), 64):
                total += float(self.loss(model, self.val_x[i:i + 64], self.val_y[i:i + 64])) * len(self.val_x[i:i + 64])
            return total / len(self.val_x)


TASKS = {"digits": DigitsTask, "lm": TextTask}
#: What :meth:`Task.optimizer` builds: SGD with momentum, or AdamW.
OPTIMIZERS = ("sgd", "adamw")


def get_task(name: str, seed: int = 0) -> Task:
    """The task ``name`` (``digits`` or ``lm``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name](seed)
