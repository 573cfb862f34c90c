"""Ok-Topk SGD outside DDP, and a short convergence run of the digits comparison."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from conservation import assert_conserved

import sparsecomm
from sparsecomm.optim import SparseGradientReducer

with torch.random.fork_rng():  # the same model whatever ran before (a test must not depend on order)
    torch.manual_seed(0)
    _MODEL = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


@pytest.mark.parametrize("P", [1, 3, 4])
def test_reducer_follows_algorithm_2(P):
    """Gradients become U/P; only contributed entries leave the residual (conservation)."""
    steps = 8

    def body(rank):
        model = copy.deepcopy(_MODEL)
        reducer = SparseGradientReducer(model.parameters(), "oktopk", 0.05,
                                        algorithm_options={"tau": 3, "tau_prime": 6})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fed = 0
        applied = 0
        selected = []
        for s in range(steps):
            g = torch.Generator().manual_seed(100 * rank + s)
            x, y = torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            fed = fed + torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
            reducer.reduce()
            step = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
            selected.append(int(step.count_nonzero()))
            applied = applied + step
            opt.step()
        return fed, applied, reducer.state.residual.double(), [p.detach().clone() for p in model.parameters()], selected

    out = sparsecomm.simulate(P, body).results
    for o in out:  # every rank applied the same update, so the models stay identical
        assert all(torch.equal(a, b) for a, b in zip(o[3], out[0][3]))
    # The update is sparse (at P = 1 a reducer that passed gradients through would
    # conserve everything too): at most the hard cap of 4k/3 entries per step.
    k = math.ceil(0.05 * sum(p.numel() for p in _MODEL.parameters()))
    assert all(0 < c <= 4 * k // 3 for c in out[0][4]), out[0][4]
    assert_conserved(out[0][1] * P, [o[2] for o in out], [o[0] for o in out], atol=1e-5)


def test_reducer_validation():
    with pytest.raises(ValueError, match="no parameter"):
        SparseGradientReducer([])
    with pytest.raises(ValueError, match="op must be 'avg' or 'sum', got 'max'"):
        SparseGradientReducer(_MODEL.parameters(), op="max")


@pytest.mark.slow
@pytest.mark.gloo
def test_short_convergence_run(tmp_path):
    from sparsecomm.tools import (
        train,  # needs scikit-learn and matplotlib: the [test] extra has them
    )

    # (two ranks: four took twice as long on two cores; training at P = 4 runs in the hook's tests)
    results = train.run(["dense", "oktopk", "dense-q4"], ranks=2, epochs=8)
    acc = {r["config"]: r["accuracy"][-1] for r in results}
    assert acc["dense"] > 0.9
    assert acc["oktopk"] > acc["dense"] - 0.05  # the full 30-epoch comparison is in the notes
    assert acc["dense-q4"] > acc["dense"] - 0.05
    by = {r["config"]: r["bytes_per_step"] for r in results}
    assert by["oktopk"] < 0.1 * by["dense"] and by["dense-q4"] < 0.2 * by["dense"]
    train.plot(results, str(tmp_path / "train.png"))
    assert (tmp_path / "train.png").stat().st_size > 10_000
    assert "oktopk" in train.format_results(results)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("schedule", ["pipesgd", "mgwfbp", "dear"])
def test_training_under_a_schedule(schedule):
    from sparsecomm.tools import train

    results = train.run(["dense", "oktopk"], ranks=2, epochs=4, schedule=schedule)
    assert [r["config"] for r in results] == [f"dense/{schedule}", f"oktopk/{schedule}"]
    acc = {r["config"].split("/")[0]: r["accuracy"][-1] for r in results}
    assert acc["dense"] > 0.85 and acc["oktopk"] > acc["dense"] - 0.1, acc
    by = {r["config"].split("/")[0]: r["bytes_per_step"] for r in results}
    assert 0 < by["oktopk"] < 0.2 * by["dense"], by
    assert "dense/" + schedule in train.format_results(results)


def test_lm_task_reads_the_standard_library_and_starts_near_uniform(tmp_path):
    import math

    from sparsecomm.tools.tasks import TextTask, get_task

    for i in range(30):
        (tmp_path / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    task = TextTask(root=str(tmp_path), context=16, width=32, layers=1, heads=2, eval_windows=8)
    text = {i: (tmp_path / f"m{i:02d}.py").read_bytes() for i in range(30)}
    assert bytes(task.val_data.to(torch.uint8).tolist()) == text[9] + text[19] + text[29]  # every tenth file
    assert len(task.train_data) == sum(len(t) for i, t in text.items() if i % 10 != 9)
    model = task.model(0)
    # Small embeddings and a tied head: the first loss is about ln 256 (a uniform guess over bytes).
    assert abs(task.evaluate(model) - math.log(256)) < 0.1
    shards = []
    for rank in range(2):
        x, y = next(task.batches(rank, 2, 4, epoch=0))
        assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
        shards.append(x)
    assert not torch.equal(shards[0], shards[1])
    opt = task.optimizer(model.parameters(), 3e-3)
    for x, y in task.batches(0, 1, 8, epoch=0):
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()
    assert task.evaluate(model) < math.log(256) - 1.0  # 50 steps on a repetitive text: learned
    assert task.optimizer(model.parameters(), 0.1, "sgd", momentum=0.5).param_groups[0]["momentum"] == 0.5
    assert task.optimizer(model.parameters(), 0.1, "sgd").param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="unknown task"):
        get_task("imagenet")
    with pytest.raises(RuntimeError, match="standard library"):
        TextTask(root=str(tmp_path / "nowhere"))


def _record(config, steps, values, per_step=1.0, comm_per_step=0.5, metric="val_loss"):
    return {"config": config, "metric": metric, "higher_is_better": metric == "accuracy",
            "compute_per_step": per_step, "local_per_step": 0.0,
            "curve": {"step": steps, metric: values,
                      **{name: [s * comm_per_step for s in steps] for name in ("1gbe", "10gbe", "pizdaint")}}}


def test_time_to_accuracy_finds_the_first_evaluation_past_each_mark():
    from sparsecomm.tools import train

    dense = _record("dense", [10, 20, 30, 40], [3.0, 2.5, 2.2, 2.0], comm_per_step=0.5)
    fast = _record("oktopk", [10, 20, 30, 40], [3.1, 2.4, 2.05, 2.01], per_step=1.0, comm_per_step=0.01)
    slow = _record("cltk", [10, 20, 30, 40], [3.5, 3.0, 2.9, 2.8], comm_per_step=0.01)
    rows = train.time_to_accuracy([dense, fast, slow])
    assert [r["config"] for r in rows] == ["dense", "oktopk", "cltk"]
    d, f, c = rows
    # Dense's marks: its metric at 25/50/75% of its curve, 1.02x and 1.00x of its final.
    assert [d[m]["value"] for m in ("dense@25%", "dense@50%", "dense@75%")] == [3.0, 2.5, 2.2]
    assert d["1.02x"]["value"] == pytest.approx(2.04) and d["1.00x"]["value"] == 2.0
    assert d["1.00x"]["step"] == 40 and d["1.00x"]["1gbe"] == pytest.approx(40 * 1.0 + 40 * 0.5)
    assert f["1.02x"]["step"] == 40 and f["dense@75%"]["step"] == 30 and f["dense@50%"]["step"] == 20
    assert f["1.02x"]["1gbe"] == pytest.approx(40 * 1.01)
    assert f["1.00x"]["step"] is None and f["1.00x"]["1gbe"] is None
    assert c["dense@25%"]["step"] == 20 and c["dense@50%"]["step"] is None
    table = train.format_time_to_accuracy(rows)
    assert "never" in table and "1.02x 2.0400" in table
    # Accuracy: higher is better, and within 2% means at least 0.98 of dense's final.
    acc = train.time_to_accuracy([_record("dense", [10, 20], [0.5, 0.9], metric="accuracy"),
                                  _record("x", [10, 20], [0.885, 0.95], metric="accuracy")])
    assert acc[1]["1.02x"]["step"] == 10 and acc[1]["1.00x"]["step"] == 20
    assert acc[0]["1.02x"]["value"] == pytest.approx(0.882)
    assert train.time_to_accuracy([fast]) == []  # no dense run: no marks


@pytest.mark.slow
@pytest.mark.gloo
def test_adamw_training_takes_demo_and_each_suffix_its_own_method(tmp_path):
    from sparsecomm.tools import train
    from sparsecomm.tools.tasks import DigitsTask

    results = train.run(["dense", "oktopk", "oktopk-sparseadamw", "oktopk-hook", "oktopk-diloco", "topka-demo"],
                        ranks=2, epochs=3, optimizer="adamw", lr=0.002, diloco_options={"sync_every": 5},
                        demo_options={"chunk": 32, "topk": 1})
    by = {r["config"]: r for r in results}
    assert by["dense"]["path"] == "ddp" and by["oktopk"]["path"] == "DeMo"
    assert by["oktopk-sparseadamw"]["path"] == "SparseAdamW"
    assert by["oktopk-hook"]["path"] == "hook" and by["oktopk-diloco"]["path"] == "DiLoCo"
    # DiLoCo: one sparse call of 1% every 5 steps, none between; it learns.
    diloco, sparse_adamw = by["oktopk-diloco"], by["oktopk-sparseadamw"]
    assert diloco["diloco_options"] == {"sync_every": 5} and diloco["accuracy"][-1] > 0.5
    assert diloco["bytes_per_step"] < 0.2 * sparse_adamw["bytes_per_step"]
    assert 0 < diloco["local_per_step"] < sparse_adamw["local_per_step"]
    # DeMo: every step one component of each chunk of 32 from each rank, none dense; under
    # AdamW the plain configuration is DeMo too, Ok-Topk carrying the components.
    # The plain configuration is the recommendation (the rms rule), -demo the method as published.
    for config, settings in (("topka-demo", {"update": "sign"}), ("oktopk", {"update": "rms", "decay": 0.99})):
        demo = by[config]
        assert demo["path"] == "DeMo" and demo["demo_options"] == {**settings, "chunk": 32, "topk": 1}
        assert demo["accuracy"][-1] > 0.5 and demo["bytes_per_step"] < 0.2 * by["dense"]["bytes_per_step"]
    assert sparse_adamw["warmup_steps"] == 10
    assert all(r["lr"] == 0.002 for r in results)  # --lr wins, DeMo's too
    # Without it, DeMo runs at its rule's share of the task's AdamW rate (the sign: half).
    plain, published = train.run(["oktopk", "oktopk-demo"], ranks=2, epochs=1, optimizer="adamw",
                                 demo_options={"chunk": 32})
    assert plain["demo_options"]["update"] == "rms" and plain["demo_options"]["decay"] == 0.99
    assert plain["lr"] == pytest.approx(DigitsTask.lr)
    assert published["demo_options"]["update"] == "sign" and published["lr"] == pytest.approx(DigitsTask.lr / 2)
    steps = 3 * sparse_adamw["steps_per_epoch"]
    assert sparse_adamw["curve"]["step"] == list(range(10, steps + 1, 10))
    assert sparse_adamw["accuracy"][-1] > by["dense"]["accuracy"][-1] - 0.1
    # Ten dense steps, then about k entries a step: far fewer bytes than dense.
    assert sparse_adamw["bytes_per_step"] < 0.5 * by["dense"]["bytes_per_step"]
    assert sparse_adamw["compute_per_step"] == by["dense"]["compute_per_step"] > 0
    assert sparse_adamw["local_per_step"] > 0 == by["dense"]["local_per_step"]
    rows = train.time_to_accuracy(results)
    # Dense reaches its own final metric by its last evaluation (earlier if it got there before).
    assert rows[0]["1.00x"]["step"] <= steps - steps % 10 and rows[0]["1.00x"]["1gbe"] > 0
    train.plot(results, str(tmp_path / "train.png"))


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("config, where", [("dense", "by step 44: the parameters"),
                                           ("oktopk", "at step 2 (a gradient"),
                                           ("oktopk-hook", "at step 2 (a gradient")])
def test_a_diverging_run_says_where_on_every_path(config, where):
    from sparsecomm.tools import train

    # A rate no model survives: DeMo and the hook refuse the NaN at once (every rank alike);
    # dense's DDP allreduce checks nothing, so the epoch's end looks at the parameters.
    said = rf"(?s){config} diverged {re.escape(where)}.*on rank\(s\) \[0, 1\]\)?; a lower --lr"
    with pytest.raises(Exception, match=said):
        train.run([config], ranks=2, epochs=1, optimizer="adamw", lr=1e37)


def test_configuration_names_follow_the_registries():
    from sparsecomm.compress import COMPRESSORS
    from sparsecomm.tools import train

    for algorithm in sparsecomm.algorithms():
        if algorithm != "dense":
            assert train.config_settings(algorithm) == {"algorithm": algorithm, "density": 0.01}
            assert train.config_settings(f"{algorithm}-hook")["hook"] is True
        assert train.config_settings(f"{algorithm}-diloco")["diloco"] is True  # dense-diloco: DiLoCo itself
        if algorithm != "dense":  # DeMo's components are sparse by construction
            assert train.own_optimizer(f"{algorithm}-demo") == "demo"
            assert train.own_optimizer(f"{algorithm}-sparseadamw") == "sparseadamw"
        for compressor in COMPRESSORS:
            assert train.config_settings(f"{algorithm}-{compressor}")["compressor"] == compressor
    assert train.config_settings("dense") is None  # DDP's own allreduce
    for bad in ("dense-hook", "oktopk-q7", "nope", "oktopk-", "dense-q8-x", "oktopk-hook-diloco", "dense-demo",
                "oktopk-demo-hook", "dense-sparseadamw", "oktopk-sparseadamw-demo"):
        with pytest.raises(ValueError, match="unknown configuration"):
            train.config_settings(bad)
    assert train.parse_config("cltk-q8/pipesgd") == ("cltk-q8", "pipesgd")


def test_an_evaluation_mid_round_is_of_the_outer_model():
    # Under DiLoCo the replicas drift between outer steps: `sparsecomm train` evaluates the
    # synced outer model there (a copy), and the replica itself is left as it was.
    from types import SimpleNamespace

    from sparsecomm.optim import DiLoCo
    from sparsecomm.tools.train import _evaluate

    def flat(m):
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()

    def body(rank):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        inner = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = DiLoCo(net, inner, sync_every=3, density=0.5)
        job = SimpleNamespace(evaluate=flat)
        seen = []
        for step in range(3):
            net(torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * rank + step))).sum().backward()
            outer.step()
            inner.zero_grad()
            replica = flat(net)
            seen.append((outer.synced, _evaluate(job, net, outer), outer.anchor.clone(), replica))
            assert torch.equal(flat(net), replica)  # evaluating moved nothing
        return seen

    for seen in sparsecomm.simulate(2, body).results:
        for synced, evaluated, anchor, replica in seen[:2]:
            assert not synced and torch.equal(evaluated, anchor) and not torch.equal(evaluated, replica)
        synced, evaluated, anchor, replica = seen[2]
        assert synced and torch.equal(evaluated, replica) and torch.equal(replica, anchor)
