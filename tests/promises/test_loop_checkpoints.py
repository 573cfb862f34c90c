"""Training-loop checkpoints written by an earlier revision load, and the run goes on bit for bit.

``tests/data/loops_<revision>.pt`` was written by ``tests/data/make_loops.py``: for every
schedule (Ok-Topk, TopkA), ``SparseAdamW`` and the DDP hook, each rank's checkpoint after
steps that leave residuals, a frozen layer's parked residual and a refused step's carried
results, and the digest of the parameters after the steps that followed. Building everything
anew, loading the checkpoint (torch's defaults) and making those steps must give the same digest:
the gradient memory a user saved is kept, whatever moves inside the library.

The digests hold where this machine's arithmetic is the fixture's (a fresh run gives its
digests). Elsewhere (another CPU's BLAS rounds products differently: ~1e-17 in the float64
models' checkpoints, a few ulps in the float32 ones') the resumed parameters must equal an
uninterrupted run's here to 1e-6 (float32 rounding): a dropped residual or carried result, a
learning rate times a gradient, moves them by orders of magnitude more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import loop_fixture
import sparsecomm
from sparsecomm.schedules import SCHEDULES

DATA = Path(__file__).resolve().parents[1] / "data"
FILE = DATA / "loops_9229a9c.pt"
SAVED = torch.load(FILE)  # weights_only=True: torch's default


def test_the_file_holds_every_schedule_the_optimizer_and_the_hook():
    assert set(SAVED) == {f"{n}/{a}" for n in SCHEDULES for a in ("oktopk", "topka")} | {"sparse_adamw", "hook"}
    # The steps left what the file is for: the schedules' checkpoints hold a parked residual,
    # the group schedules' a carried result, the hook's both residuals and carried results.
    wfbp = SAVED["wfbp/oktopk"]["checkpoints"][0]["sched"]
    assert wfbp["parked"] and wfbp["carried"]
    hook = SAVED["hook"]["checkpoints"][0]["hook"]
    assert hook["residuals"] and hook["carried"]


def _resumed_as_saved(resumed: list, straight: list, saved: list[str]) -> None:
    """``resumed``: the saved checkpoints' runs; ``straight``: uninterrupted runs here."""
    if [d for _, d in straight] == saved:  # this machine computes as the fixture's did
        assert [d for _, d in resumed] == saved
    for (_, got), (_, want) in zip(resumed, straight):
        torch.testing.assert_close(got.flat, want.flat, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", sorted(k for k in SAVED if "/" in k))
def test_a_saved_schedule_resumes_bit_for_bit(key):
    name, algorithm = key.split("/")
    saved = SAVED[key]
    runs = sparsecomm.simulate(2, lambda r: loop_fixture.schedule_loop(r, name, algorithm, saved["checkpoints"][r]),
                               timeout=60).results
    straight = sparsecomm.simulate(2, lambda r: loop_fixture.schedule_loop(r, name, algorithm), timeout=60).results
    _resumed_as_saved(runs, straight, saved["digests"])


def test_a_saved_sparse_adamw_resumes_bit_for_bit():
    saved = SAVED["sparse_adamw"]
    runs = sparsecomm.simulate(2, lambda r: loop_fixture.adamw_loop(r, saved["checkpoints"][r]), timeout=60).results
    straight = sparsecomm.simulate(2, loop_fixture.adamw_loop, timeout=60).results
    _resumed_as_saved(runs, straight, saved["digests"])


@pytest.mark.slow
@pytest.mark.gloo
def test_a_saved_hook_resumes_bit_for_bit():
    from engines import run_gloo

    saved = SAVED["hook"]
    runs = run_gloo(2, loop_fixture.hook_loop, saved["checkpoints"])
    _resumed_as_saved(runs, run_gloo(2, loop_fixture.hook_loop), saved["digests"])
