"""Sparse gradient reduction inside FSDP2 (``sparsecomm.fsdp.enable``) on gloo: the flat mode at
2 and 3 ranks, custom HSDP at 2 x 2. Density 1 is plain FSDP/HSDP to rounding (also with 4
accumulated micro-batches and a parameter unused in some steps); at density 0.1 nothing is lost,
a checkpoint resumes bit for bit, a NaN on one rank stops (or, with a GradScaler, skips) the
step on every rank and the next one trains; bf16 reductions; refusals."""

from __future__ import annotations

import math

import pytest
import torch

import engines
import fsdp_cases

pytestmark = [pytest.mark.slow, pytest.mark.gloo]


@pytest.fixture(scope="module")
def worlds():
    return {"flat2": engines.run_gloo(2, fsdp_cases.suite, False), "flat3": engines.run_gloo(3, fsdp_cases.suite, False),
            "hsdp4": engines.run_gloo(4, fsdp_cases.suite, True), "hsdp2": engines.run_gloo(2, fsdp_cases.suite, True)}


#: hsdp2: two replicas of one rank each (one GPU a node), where FSDP divides nothing after the hook.
WORLDS = ["flat2", "flat3", "hsdp4", "hsdp2"]


@pytest.mark.parametrize("world", WORLDS)
def test_density_one_is_plain_fsdp(worlds, world):
    # Bit for bit where a sum has two terms (P = 2, HSDP's two replicas), to rounding at P = 3
    # (gloo sums three in another order than the sparse exchange's step order; three steps
    # amplify that by up to ~1e-5 on some CPUs, where a lost rank's share is ~lr x a gradient).
    for rank in worlds[world]:
        for accumulate, (plain, sparse, calls) in zip((1, 4), rank["equals"][:2]):
            if world == "flat3":
                torch.testing.assert_close(plain, sparse, rtol=1e-4, atol=1e-5)
            else:
                assert torch.equal(plain, sparse), (world, accumulate)
            assert calls == 9  # 3 modules x 3 steps: the unused head still reduced, one call a step
        assert not torch.equal(rank["equals"][0][0], rank["equals"][1][0])  # accumulation changed something
        plain, warm, dense_calls = rank["equals"][2]
        assert dense_calls == 9 and torch.equal(plain, warm)  # warm-up steps: FSDP's own reductions
        plain, sparse, names = rank["equals"][3]  # a frozen bias: not in the layout, not moved
        if world == "flat3":
            torch.testing.assert_close(plain, sparse, rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(plain, sparse)
        assert "a.bias" not in names and "a.weight" in names
        plain, near, _ = rank["equals"][4]  # bfloat16 values on the wire
        assert not torch.equal(plain, near)
        torch.testing.assert_close(plain, near, rtol=2e-2, atol=2e-2)
        assert "a parameter was frozen or unfrozen after enable()" in rank["equals"][5]


@pytest.mark.parametrize("world", WORLDS)
def test_nothing_is_lost(worlds, world):
    # Per module, over 4 steps: what every call received plus every residual is what every
    # call was fed (flat: the owner's shards, concatenated; HSDP: per shard, its two replicas).
    runs = [r["conservation"] for r in worlds[world]]
    P = len(runs)
    for key in runs[0]["fed"]:
        if world.startswith("flat"):
            got = torch.cat([r["got"][key] for r in runs])
            torch.testing.assert_close(got + sum(r["residuals"][key] for r in runs), sum(r["fed"][key] for r in runs),
                                       rtol=1e-6, atol=1e-5)
        else:
            half = P // 2
            replicas = 2 if half == 1 else 1  # one rank a shard: the hook averages the replicas
            for s in range(half):
                a, b = runs[s], runs[s + half]  # replicas of shard s
                assert torch.equal(a["got"][key], b["got"][key])
                torch.testing.assert_close(replicas * a["got"][key] + a["residuals"][key] + b["residuals"][key],
                                           a["fed"][key] + b["fed"][key], rtol=1e-6, atol=1e-5)
    assert all(r["bytes"] > 0 for r in runs)
    assert any(r["residuals"][key].abs().max() > 0 for r in runs for key in r["residuals"])  # sparse: it kept some


@pytest.mark.parametrize("world", WORLDS)
def test_a_checkpoint_resumes_bit_for_bit(worlds, world):
    for rank in worlds[world]:
        assert rank["resume"] == {"None": True, "torch.bfloat16": True}


@pytest.mark.parametrize("world", WORLDS)
def test_a_nan_on_one_rank_stops_or_skips_the_step_everywhere(worlds, world):
    for scaler, outcome in ((False, "raised"), (True, "trained")):
        runs = [r["non_finite"][scaler] for r in worlds[world]]
        for run in runs:
            # (outcome, parameters unchanged, residuals unchanged) per step; the NaN at step 2
            assert [s[0] for s in run["log"]] == ["trained", "trained", outcome, "trained"]
            assert run["log"][2][1:] == (True, True) and not run["log"][3][1]
            assert run["finite"] and torch.equal(run["final"], runs[0]["final"])
            assert scaler or run["after_a_failed_backward"] == "raised"


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_reductions(worlds, world):
    for plain, dense, sparse, calls in (r["mixed_precision"] for r in worlds[world]):
        if world == "flat3":  # three bf16 terms summed in another order
            torch.testing.assert_close(plain, dense, rtol=2e-2, atol=2e-2)
        else:
            assert torch.equal(plain, dense)
        assert calls == 9 and bool(torch.isfinite(sparse).all())
        assert not torch.equal(plain, sparse)


@pytest.mark.parametrize("world", ["hsdp4", "hsdp2"])
def test_a_nan_in_one_shard_raises_on_every_rank_of_the_node(worlds, world):
    # The node's dense reduce-scatter takes a NaN to one shard's ranks only: the others agree.
    assert [r["shard_nan"] for r in worlds[world]] == [["raised", "trained"]] * len(worlds[world])


def test_enable_refuses_what_it_cannot_serve_on_every_rank(worlds):
    seen = [r["refusals"] for r in worlds["hsdp4"]]
    assert all(s == seen[0] for s in seen) and len(seen[0]) == 8
    for msg, words in zip(seen[0], ("runs ('oktopk', 'topkdsa'), not 'topka'", "settings differ (warmup_steps)",
                                    "native 2-D (HSDP) mesh",
                                    "parameters differ at the start", "already has a gradient divide factor",
                                    "no FSDP module", "DeMo: the parameters are sharded",
                                    "SparseAdamW: the parameters are sharded")):
        assert words in msg, msg


def test_outer_steps_across_fsdp_replicas(worlds):
    # DiLoCo over custom HSDP: FSDP inside each replica every inner step, the replicas' shards
    # synced every 3 by the sparse allreduce; the replicas of a shard hold the same values after
    # every outer step, and the moved outer shard plus the residuals is every pseudo-gradient fed.
    runs = [r["diloco"] for r in worlds["hsdp4"]]
    half = len(runs) // 2
    for s in range(half):
        a, b = runs[s], runs[s + half]
        assert len(a["shards"]) == 3 and all(torch.equal(x, y) for x, y in zip(a["shards"], b["shards"]))
        torch.testing.assert_close(2 * a["moved"] + a["residual"] + b["residual"], a["fed"] + b["fed"],
                                   rtol=1e-5, atol=1e-5)
        assert a["residual"].abs().max() > 0  # sparse: the selection left some
    assert all(math.isfinite(x) for r in runs for x in r["losses"])


def test_parked_bf16_residuals_follow_the_loss_scale():
    # Residuals hold scaled gradients; when the scaler's scale moves, those kept in bfloat16
    # between calls are multiplied by new/old as the states' own are.
    import types

    from sparsecomm.fsdp import FSDPState
    from sparsecomm.memory import StateMaker

    class Scaler:
        scale = 8.0

        def is_enabled(self):
            return True

        def get_scale(self):
            return self.scale

    scaler = Scaler()
    state = FSDPState([], StateMaker("oktopk", 0.1, None, True, None, None), "flat", None, 1, 0, torch.bfloat16, scaler)
    module = types.SimpleNamespace(key="a", stored=torch.tensor([1.0, -3.0], dtype=torch.bfloat16))
    state.modules["a"] = module
    state._follow_scale()  # the first read: nothing to follow yet
    scaler.scale = 4.0
    state._follow_scale()
    assert torch.equal(module.stored, torch.tensor([0.5, -1.5], dtype=torch.bfloat16))
