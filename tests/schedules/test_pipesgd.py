"""Pipe-SGD (schedules/pipesgd.py): a one-step-stale update, exactly, across checkpoints."""

from __future__ import annotations


import pytest
import torch

import sparsecomm
from sparsecomm.schedules.engine import grads_in

from schedule_cases import STEPS, loss_of, make_model, make_optimizer, stale_reference, train_steps


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("algorithm,density,compressor", [("dense", 1.0, None), ("oktopk", 0.05, None),
                                                          ("topka", 0.1, "q8"), ("dense", 1.0, "q4")])
@pytest.mark.parametrize("P,warmup,set_to_none", [(1, 0, True), (3, 2, True), (3, 2, False), (2, 0, False)])
def test_pipesgd_equals_a_one_step_stale_reference(P, warmup, set_to_none, kind, algorithm, density, compressor,
                                                    monkeypatch):
    from sparsecomm.schedules import PipeSGD, pipesgd

    gathered_in_place = []
    monkeypatch.setattr(pipesgd, "grads_in", lambda *a: gathered_in_place.append(grads_in(*a)) or gathered_in_place[-1])

    def body(rank: int):
        model = make_model()
        opt = make_optimizer(kind, model.parameters())
        sched = PipeSGD(model, opt, warmup_steps=warmup, algorithm=algorithm, density=density,
                        compressor=compressor)
        train_steps(model, opt, sched, rank, STEPS + 1, set_to_none=set_to_none)
        # The gradients are views of the last result, the next step's gather buffer.
        assert grads_in(sched.params, sched._buffers[sched.step_count % 3])
        sched.flush()
        sched.close()
        got = [p.detach().clone() for p in model.parameters()]
        want = stale_reference(rank, kind, algorithm, density, compressor, warmup, STEPS + 1)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    assert all(sparsecomm.simulate(P, body, timeout=60).results)
    # Zeroed in place, steps max(warmup, 1) + 1 .. STEPS find the gradients in their buffer
    # (the first two of a run without warm-up have fresh ones, the first pipelined step the
    # warm-up's last result).
    assert sum(gathered_in_place) == (P * (STEPS - max(warmup, 1)) if not set_to_none else 0)


def test_pipesgd_checkpoint_keeps_the_gradient_in_flight():
    import io

    from sparsecomm.schedules import PipeSGD

    def run(rank: int, resume_at: int | None):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = PipeSGD(model, opt, algorithm="oktopk", density=0.05)
        for step in range(6):
            if step == resume_at:  # save everything, rebuild from scratch, load
                blob = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                           blob)
                sched.close()
                blob.seek(0)
                saved = torch.load(blob, weights_only=False)
                model = make_model()
                model.load_state_dict(saved["model"])
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                opt.load_state_dict(saved["opt"])
                sched = PipeSGD(model, opt, algorithm="oktopk", density=0.05)
                sched.load_state_dict(saved["sched"])
                assert saved["sched"]["in_flight"] is not None
            opt.zero_grad()
            loss_of(model, rank, step).backward()
            sched.step()
        sched.flush()
        sched.close()
        return [p.detach().clone() for p in model.parameters()]

    def body(rank: int):
        straight, resumed = run(rank, None), run(rank, 3)
        return all(torch.equal(a, b) for a, b in zip(straight, resumed))

    assert all(sparsecomm.simulate(2, body, timeout=60).results)
