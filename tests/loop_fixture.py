"""Training loops that leave every kind of gradient memory in a checkpoint (residuals, a frozen
layer's parked residual, a refused step's carried results), for ``tests/data/make_loops.py``.

Each loop runs :data:`BEFORE`, takes a checkpoint as users do (model, optimizer, the library's
object), then runs :data:`AFTER`; given a checkpoint it builds everything anew, loads it and runs
:data:`AFTER` only. Either way it returns a digest of the parameters at the end, so a checkpoint
written by one revision and resumed by another must give the first one's digest.
"""

from __future__ import annotations

import hashlib
import io

import torch

import loop_cases

#: Steps before the checkpoint: a plain one, the first layer frozen, a NaN in rank 1's
#: gradient of the third parameter (that call is refused, the step's others are carried).
BEFORE = ["plain", "freeze", "refuse 1 2"]
#: Steps after it: the frozen layer trains again, so its parked residual is sent.
AFTER = ["plain", "thaw", "plain"]


class Digest(str):
    """The parameters' sha256 (what the fixture stores), carrying the parameters themselves
    (``flat``, float64) for a comparison to rounding on a machine whose arithmetic differs."""

    flat: torch.Tensor

    def __reduce__(self):
        return _digest_of, (str(self), self.flat)


def _digest_of(text: str, flat: torch.Tensor) -> "Digest":
    d = Digest(text)
    d.flat = flat
    return d


def digest(params) -> Digest:
    h = hashlib.sha256()
    params = [p.detach().contiguous() for p in params]
    for p in params:
        h.update(p.numpy().tobytes())
    return _digest_of(h.hexdigest(), torch.cat([p.reshape(-1).double() for p in params]))


def _roundtrip(obj: dict) -> dict:
    """Through torch.save and torch.load with torch's defaults (weights_only=True)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _checkpoint(saved: dict | None, before, parts: dict) -> dict | None:
    """Run ``before`` and return a checkpoint of ``parts`` (name -> an object with a state_dict),
    taken through torch.save at once (a state_dict's tensors are the live ones, which later
    steps change); or, given ``saved``, load it into them, in that order, and return None."""
    if saved is None:
        before()
        return _roundtrip({name: part.state_dict() for name, part in parts.items()})
    saved = _roundtrip(saved)
    for name, part in parts.items():
        part.load_state_dict(saved[name])
    return None


def _poison(param: torch.nn.Parameter):
    return param.register_hook(lambda g: g * float("nan"))


def _schedule_steps(rank: int, name: str, net, opt, sched, events: list[str], first: int) -> None:
    for step, event in enumerate(events, first):
        kind, *args = event.split()
        params = list(net.parameters())
        if kind in ("freeze", "thaw"):
            for p in params[:2]:
                p.requires_grad_(kind == "thaw")
        handles = [_poison(params[int(args[1])])] if kind == "refuse" and int(args[0]) == rank else []
        try:
            opt.zero_grad()
            x, y = loop_cases.batch(rank, step)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            sched.step()
        except Exception:  # noqa: BLE001 - the refused step: the loop skips it, as users' loops do
            pass
        finally:
            for h in handles:
                h.remove()
    try:
        sched.finish()
    except Exception:  # noqa: BLE001 - DeAR and Pipe-SGD find a refusal a step late
        pass


def schedule_loop(rank: int, name: str, algorithm: str, saved: dict | None = None) -> tuple[dict | None, str]:
    """One schedule's loop on this rank (``sparsecomm.simulate``): (its checkpoint, the digest)."""
    net, opt, sched = loop_cases.build(name, algorithm)
    ckpt = _checkpoint(saved, lambda: _schedule_steps(rank, name, net, opt, sched, BEFORE, 0),
                       {"model": net, "opt": opt, "sched": sched})
    _schedule_steps(rank, name, net, opt, sched, AFTER, len(BEFORE))
    sched.close()
    return ckpt, digest(net.parameters())


def adamw_loop(rank: int, saved: dict | None = None) -> tuple[dict | None, str]:
    """``SparseAdamW``'s loop on this rank (simulated; no freeze: it has no layer groups)."""
    import sparsecomm
    from sparsecomm.optim import SparseAdamW

    net = loop_cases.model()
    opt = SparseAdamW(net.parameters(), lr=1e-2, density=0.2, warmup_steps=1,
                      comm=sparsecomm.comm.sim.current_sim_comm())

    def steps(events: list[str], first: int) -> None:
        for step, event in enumerate(events, first):
            handles = [_poison(list(net.parameters())[2])] if event.startswith("refuse") and rank == 1 else []
            try:
                net.zero_grad(set_to_none=True)
                x, y = loop_cases.batch(rank, step)
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
            except sparsecomm.InputError:  # the NaN: the step is skipped on every rank
                pass
            finally:
                for h in handles:
                    h.remove()

    ckpt = _checkpoint(saved, lambda: steps(BEFORE, 0), {"model": net, "opt": opt})
    steps(AFTER, len(BEFORE))
    return ckpt, digest(net.parameters())


def hook_loop(rank: int, size: int, checkpoints: list | None = None) -> tuple[dict | None, str]:
    """The DDP hook's loop on this rank (gloo): several buckets, a refused step's results carried;
    ``checkpoints``: every rank's, to resume from."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hook_cases
    from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook

    net = DDP(hook_cases._model(hook_cases.Shuffled), bucket_cap_mb=0.01)
    state = SparseHookState(net, "oktopk", 0.05, min_bucket_elements=0, algorithm_options={"tau": 3, "tau_prime": 4})
    net.register_comm_hook(state, sparse_allreduce_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def steps(first: int, last: int, bad: int | None) -> None:
        for step in range(first, last):
            handles = [_poison(list(net.parameters())[2])] if step == bad and rank == 1 else []
            x, y = hook_cases.batch(rank, step)
            opt.zero_grad()
            try:
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
            except Exception:  # noqa: BLE001 - the refused step, raised by backward on every rank
                pass
            finally:
                for h in handles:
                    h.remove()

    saved = None if checkpoints is None else checkpoints[rank]
    # A checkpoint from the second step on resumes exactly.
    ckpt = _checkpoint(saved, lambda: steps(0, 4, bad=3), {"model": net, "opt": opt, "hook": state})
    steps(4, 8, bad=None)
    return ckpt, digest(net.parameters())
