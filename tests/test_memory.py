"""The gradient memory's rules, in one process: residuals moved between calls, results carried
past a refused step, the loss scale they follow (``sparsecomm.memory``).

The training loops that use it (the hook, the schedules) hold these rules end to end on gloo
and MPI; here each rule is checked alone, exactly, in milliseconds.
"""

from __future__ import annotations

import pickle

import pytest
import torch

import sparsecomm
from sparsecomm.memory import (Carry, GradientMemory, LossScale, StateMaker, join_flat, split_flat, state_settings)

SIZES = [3, 5, 2]


def _flat(seed: int) -> torch.Tensor:
    return torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(seed))


def test_a_residual_split_per_parameter_joins_back_bit_for_bit():
    flat = _flat(0)
    parts = split_flat(["a", "b", "c"], SIZES, flat)
    assert [p.numel() for p in parts.values()] == SIZES
    parts["a"] += 0  # copies: the call's buffer may be reused
    assert parts["a"].data_ptr() != flat.data_ptr()
    # Another order takes each part where it belongs, zeros where a key has none, and empties the store.
    held = dict(parts)
    joined = join_flat(["c", "x", "a"], [2, 4, 3], held)
    assert torch.equal(joined, torch.cat([flat[8:], torch.zeros(4), flat[:3]]))
    assert list(held) == ["b"]
    assert join_flat(["x"], [4], held) is None  # nothing held: a state starts without


def test_carried_results_add_up_and_come_back_once():
    carry = Carry()
    carry.keep_flat([0, 1, 2], SIZES, _flat(1))
    carry.keep_flat([1], [5], _flat(2)[:5])
    assert torch.equal(carry.take(1), _flat(1)[3:8] + _flat(2)[:5])
    assert carry.take(1) is None
    carry.scale(0.5)
    assert torch.equal(carry.take(0), _flat(1)[:3] * 0.5)


def test_carried_results_load_from_flat_and_from_shaped_checkpoints():
    # Checkpoints before the memory was one module kept the schedules' carried results shaped.
    carry = Carry()
    carry.load({0: torch.ones(2, 3), 1: torch.arange(4.0)}, key_of=lambda i: f"p{i}")
    assert carry.values["p0"].shape == (6,) and torch.equal(carry.values["p1"], torch.arange(4.0))
    assert set(carry.state_dict({"p0": 0, "p1": 1})) == {0, 1}


def test_carried_results_reach_the_gradients_of_their_parameters():
    p = torch.nn.Parameter(torch.zeros(2, 3))
    carry = Carry()
    carry.keep([p], torch.arange(6.0))
    carry.add_into([p])  # no gradient yet: kept for the next step
    assert id(p) in carry.values
    p.grad = torch.ones(2, 3)
    carry.add_into([p])
    assert torch.equal(p.grad, torch.arange(6.0).view(2, 3) + 1) and not carry.values


class _Scaler:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self.scale


def test_the_loss_scale_is_followed_by_its_ratio_and_not_pickled():
    scaler = _Scaler(1024.0)
    follow = LossScale(scaler)
    assert follow.moved() is None  # the first step: nothing held yet in another scale
    scaler.scale = 512.0
    assert follow.moved() == 0.5 and follow.moved() is None
    assert follow.moved_to(2048.0) == 4.0
    back = pickle.loads(pickle.dumps(follow))
    assert back.scaler is None and back.value == 2048.0


def _memory(algorithm: str, dense_keeps: bool) -> GradientMemory:
    return GradientMemory(StateMaker(algorithm, 0.1, None, True, None, None, dense_keeps_residual=dense_keeps))


@pytest.mark.parametrize("dense_keeps", [True, False])
def test_a_parked_residual_goes_to_the_next_sparse_state(dense_keeps):
    mem = _memory("oktopk", dense_keeps)
    mem.park([0, 1, 2], SIZES, _flat(3))
    st = mem.maker.make("oktopk")
    mem.give(st, [2, 0], [2, 3])
    assert torch.equal(st.residual, torch.cat([_flat(3)[8:], _flat(3)[:3]])) and list(mem.parked) == [1]


def test_a_dense_call_takes_a_parked_residual_into_its_state_or_its_input():
    # The schedules: the dense state keeps it (switched to error feedback).
    mem = _memory("dense", True)
    mem.park([0], [10], _flat(4))
    st = mem.maker.make("dense")
    assert not st.error_feedback
    mem.give(st, [0], [10])
    assert st.error_feedback and torch.equal(st.residual, _flat(4)) and not mem.parked
    # The hook: it waits, is added to the call's input, and is forgotten once the call went through.
    mem = _memory("dense", False)
    mem.park([0], [10], _flat(4))
    st = mem.maker.make("dense")
    mem.give(st, [0], [10])
    assert not st.error_feedback and st.residual is None and 0 in mem.parked
    buf = _flat(5)
    owed = mem.owed([0], [10], buf)
    assert torch.equal(buf, _flat(5) + _flat(4)) and owed == [0]
    assert torch.equal(mem.parked[0], _flat(4))  # a refused call leaves it exactly as it was
    mem.settle(owed)
    assert not mem.parked


def test_auto_keeps_dense_residuals_in_the_state_only_where_asked():
    for keeps in (True, False):
        maker = StateMaker("auto", 0.1, None, True, None, "1gbe", dense_keeps_residual=keeps)
        assert maker.make("dense").error_feedback is keeps
        assert maker.make("oktopk").error_feedback


def test_rescaling_reaches_states_parked_residuals_and_carried_results():
    mem = _memory("topka", True)
    st = mem.maker.make("topka")
    st.residual = _flat(6)
    mem.park([1], [4], _flat(7)[:4])
    mem.carry.keep_flat([2], [3], _flat(8)[:3])
    mem.rescale(None, [st])  # the scale did not move
    assert torch.equal(st.residual, _flat(6))
    mem.rescale(2.0, [st])
    assert torch.equal(st.residual, _flat(6) * 2) and torch.equal(mem.parked[1], _flat(7)[:4] * 2)
    assert torch.equal(mem.carry.values[2], _flat(8)[:3] * 2)


def test_a_saved_state_is_compared_with_the_one_the_maker_would_make_there():
    maker = StateMaker("auto", 0.05, None, True, None, "1gbe")
    saved = maker.make("oktopk2d")
    assert state_settings(maker.like(saved)) == state_settings(saved)  # auto's saved choice stands
    # One auto does not choose from, or another density: the maker's own state, not the saved one.
    assert type(maker.like(sparsecomm.TopkAState(0.05))) is sparsecomm.OkTopkState
    assert state_settings(StateMaker("oktopk2d", 0.1, None, True, None, None).like(saved)) != state_settings(saved)


def test_the_memory_checkpoint_holds_positions_and_loads_under_new_keys():
    # The schedules key by id(p), which does not outlive the process: a checkpoint holds
    # positions, and a new process's memory takes them back under its own keys.
    a, b, c = object(), object(), object()
    mem = _memory("oktopk", True)
    mem.park([id(a), id(c)], [3, 2], torch.cat([_flat(1)[:3], _flat(1)[:2]]))
    mem.carry.keep_flat([id(b)], [5], _flat(2)[:5])
    mem.scale.value = 1024.0
    saved = pickle.loads(pickle.dumps(mem.state_dict({id(a): 0, id(b): 1, id(c): 2})))
    assert set(saved["parked"]) == {0, 2} and set(saved["carried"]) == {1} and saved["scale"] == 1024.0
    new = [object(), object(), object()]
    again = _memory("oktopk", True)
    again.load_state_dict(saved, lambda i: id(new[i]), lambda i: torch.device("cpu"))
    assert torch.equal(again.parked[id(new[0])], _flat(1)[:3]) and torch.equal(again.parked[id(new[2])], _flat(1)[:2])
    assert torch.equal(again.carry.take(id(new[1])), _flat(2)[:5]) and again.scale.value == 1024.0
    again.load_state_dict({"scale": None})  # a loop's checkpoint from before it carried anything
    assert not again.parked and not again.carry.values and again.scale.value is None


def test_the_hook_layouts_keep_every_residual_through_drops_new_states_and_checkpoints():
    # hook_layouts.Layouts: a dropped layout parks its residuals per parameter, the next layout
    # over them takes them, and the checkpoint's residuals land where they were; nothing is lost.
    from sparsecomm.hook_layouts import Layouts

    mem = _memory("topka", True)
    lay = Layouts(SIZES)
    lay.hold((0, 1, 2))
    st = lay.state((0, 1, 2), mem, None, torch.device("cpu"))
    st.residual = _flat(9)
    lay.drop((0, 1, 2), mem)
    assert not lay.held and not lay.states and torch.equal(torch.cat([mem.parked[i] for i in (0, 1, 2)]), _flat(9))
    lay.hold((2, 0))
    st = lay.state((2, 0), mem, None, torch.device("cpu"))
    assert torch.equal(st.residual, torch.cat([_flat(9)[8:], _flat(9)[:3]])) and list(mem.parked) == [1]
    assert lay.decide((2, 0), adopt=True) == "inplace" and lay.decide((1,), adopt=True) == "new"
    saved = {"step": 3, "residuals": lay.residuals(mem), "totals": {}, **lay.state_dict()}
    assert torch.equal(torch.cat([saved["residuals"][i] for i in (0, 1, 2)]), _flat(9))
    # Loaded where the maker makes the same states: the saved state goes on with its residuals.
    mem2, lay2 = _memory("topka", True), Layouts(SIZES)
    lay2.check(saved)
    lay2.load(pickle.loads(pickle.dumps(saved)), mem2)
    assert list(lay2.held) == [(2, 0)] and torch.equal(lay2.states[(2, 0)].residual, st.residual)
    assert list(mem2.parked) == [1] and torch.equal(mem2.parked[1], _flat(9)[3:8])
    # Where it makes others: a warning, and every residual waits per parameter for the new states.
    mem3, lay3 = _memory("oktopk", True), Layouts(SIZES)
    with pytest.warns(UserWarning, match="TopkAState.*OkTopkState"):
        lay3.load(pickle.loads(pickle.dumps(saved)), mem3)
    assert not lay3.states and torch.equal(torch.cat([mem3.parked[i] for i in (0, 1, 2)]), _flat(9))
    with pytest.raises(ValueError, match="another model"):
        Layouts([3, 5]).check(saved)
