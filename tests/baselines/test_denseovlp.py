"""DenseOvlp: bucketed dense allreduce overlapped with backward equals plain averaging."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import sparsecomm
from sparsecomm.baselines import DenseOverlap


def _build() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                                   torch.nn.ReLU(), torch.nn.Linear(32, 5))


_MODEL = _build()


def make_model() -> torch.nn.Module:
    # Simulated ranks are threads sharing torch's global RNG: copy one model, never re-seed.
    return copy.deepcopy(_MODEL)


def local_grads(rank: int, step: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    model = make_model()
    x = torch.randn(16, 20, generator=torch.Generator().manual_seed(100 * rank + step))
    model(x).pow(2).mean().backward()
    return model, [p.grad.clone() for p in model.parameters()]


def overlap_body(rank: int, bucket_bytes: int, steps: int = 3):
    model = make_model()
    ovlp = DenseOverlap(model, bucket_bytes=bucket_bytes)
    grads = []
    for step in range(steps):
        model.zero_grad(set_to_none=False)
        x = torch.randn(16, 20, generator=torch.Generator().manual_seed(100 * rank + step))
        model(x).pow(2).mean().backward()
        ovlp.synchronize()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads, len(ovlp.buckets), ovlp.stats


@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("bucket_bytes", [1, 4096, 1 << 30])
def test_matches_averaged_gradients(P, bucket_bytes):
    res = sparsecomm.simulate(P, overlap_body, bucket_bytes, timeout=30).results
    for step in range(3):
        expected = [sum(local_grads(r, step)[1][i] for r in range(P)) / P for i in range(6)]
        for grads, _, _ in res:
            for got, exp in zip(grads[step], expected):
                torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-7)
    nbuckets = res[0][1]
    # Reversed sizes in bytes: 20, 640, 128, 8192 | 256, 5120: a bucket closes once it reaches the target.
    assert nbuckets == {1: 6, 4096: 2, 1 << 30: 1}[bucket_bytes]
    if P > 1:
        assert len(res[0][2]["bucket_bytes_sent"]) == 3 and all(b > 0 for b in res[0][2]["bucket_bytes_sent"][0])


def test_buckets_are_reduced_while_backward_runs():
    # The overlap itself, which matching the averages cannot show: with one bucket per
    # parameter, the last layer's bucket is summed before backward reaches the first layer.
    def body(rank):
        model = make_model()
        ovlp = DenseOverlap(model, bucket_bytes=1)
        sent_then = []

        def first_layer_gradient(grad):
            with ovlp.comm.idle():  # let the peers and this rank's communication thread run
                deadline = time.monotonic() + 10
                while ovlp.comm.stats.bytes_sent == 0 and time.monotonic() < deadline:
                    time.sleep(0.005)
            sent_then.append(ovlp.comm.stats.bytes_sent)

        model[0].weight.register_hook(first_layer_gradient)
        x = torch.randn(16, 20, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).mean().backward()
        ovlp.synchronize()
        return sent_then

    for sent_then in sparsecomm.simulate(2, body, timeout=30).results:
        assert len(sent_then) == 1 and sent_then[0] > 0, sent_then


def test_bad_arguments():
    with pytest.raises(ValueError, match="op must be 'avg' or 'sum', got 'max'"):
        DenseOverlap(make_model(), op="max")
    with pytest.raises(ValueError, match="bucket_bytes"):
        DenseOverlap(make_model(), bucket_bytes=0)
    with pytest.raises(RuntimeError, match="before any gradient"):
        DenseOverlap(make_model()).synchronize()
