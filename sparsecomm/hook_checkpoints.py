"""Checkpoints of the DDP hook's state: what ``state_dict`` saves, how ``load_state_dict`` restores it, pickling.

A mixin of :class:`sparsecomm.hooks.SparseHookState` (the hook's own module
keeps the buckets and the reductions): per-parameter residuals and carried
results, per-layout algorithm states, the layouts and the last step's orders,
the loss scale; a checkpoint of another model is refused at load, and saved
states made with other settings give only their residuals.
"""

from __future__ import annotations

import warnings

import torch

from .memory import GradientMemory, StateMaker, state_settings

__all__ = ["HookCheckpoints"]


class HookCheckpoints:
    """``state_dict``/``load_state_dict`` of :class:`~sparsecomm.hooks.SparseHookState`."""

    def state_dict(self) -> dict:
        """What a checkpoint needs (take it between steps): step, per-parameter residuals and carried
        results, per-layout algorithm states, the layouts and the last step's orders, the scale."""
        algo = {}
        for key, st in self.layout_states.items():
            copy = st.__class__.__new__(st.__class__)
            copy.__dict__ = {**st.__dict__, "residual": None}
            algo[key] = copy
        return {"step": self.step, "residuals": self.residuals(), "algorithm_states": algo,
                "totals": dict(self.totals), "layouts": list(self._layouts), "carried": self.carried(),
                "staged": list(self._staged_last),
                "orders": None if self._orders_last is None else list(self._orders_last),
                "scale": self._memory.scale.value}

    def __getstate__(self) -> dict:  # communicators, engines and scalers do not pickle; buffers are rebuilt
        d = dict(self.__dict__)
        d["_canonical"], d["_starts_cache"] = {}, {}
        d["_comm"] = d["_engine"] = d["scaler"] = d["_calling"] = d["_live"] = d["_broken"] = None
        d["group"] = d["_comm_arg"] = None
        return d

    def __setstate__(self, d: dict) -> None:
        d = dict(d)
        if "buckets" in d:  # pickled before the layouts' states had their own name
            d["layout_states"] = d.pop("buckets")
        self.__dict__.update(d)
        if "_memory" not in d:  # pickled before the gradient memory was one object
            maker = StateMaker(self.algorithm, self.density, self.algorithm_options, self.error_feedback,
                               self.compressor, getattr(self, "network", None), dense_keeps_residual=False)
            self._memory = GradientMemory(maker)
            self._memory.parked = self.__dict__.pop("_pending", {})
            self._memory.carry.values = self.__dict__.pop("_carried", {})
            self._memory.scale.value = self.__dict__.pop("_scale", None)
            self.__dict__.pop("spec", None)
        if "_layouts" not in d:  # pickled before layouts were held: its states' layouts
            self._layouts, self._holder = {}, {}
            for key in list(self.layout_states):
                self._hold(key)
            self._staged_last, self._orders_last = [], None
            self._resumed, self.scaler = False, None
            self._canonical, self._starts_cache, self._calling, self._live, self._broken = {}, {}, None, None, None
            self.totals.setdefault("refused_steps", 0)
            self.__dict__.pop("_reordered", None)

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict`: the step, every parameter's residual, the layouts and their states.

        1. A checkpoint of another model (a residual, carried result or layout naming
           a parameter this model lacks, or one of another size) raises ValueError
           here, not at the first bucket.
        2. This hook's settings (algorithm, density, options, error feedback) win, as the
           user just gave them: a saved state made with other settings is dropped (with a
           warning naming both); its residuals carry over to the states this hook makes,
           so the gradient memory goes on while thresholds and boundaries start afresh.
           With the same settings the run resumes bit for bit.
        3. The next step takes its layout decisions from the orders of the step before
           the checkpoint; DDP's initial buckets are staged into them.
        """
        self._check_checkpoint(d)
        maker = self._memory.maker
        kept = {key: st for key, st in d["algorithm_states"].items()
                if state_settings(st) == state_settings(maker.like(st))}
        if len(kept) < len(d["algorithm_states"]):
            other = next(st for key, st in d["algorithm_states"].items() if key not in kept)
            warnings.warn(f"SparseHookState.load_state_dict: the checkpoint's bucket states were made with "
                          f"{state_settings(other)}, this hook makes {state_settings(maker.like(other))}: their "
                          "residuals carry over, their thresholds and boundaries start afresh", stacklevel=2)
        self.step = d["step"]
        self.totals = {"refused_steps": 0, **d["totals"]}
        self._canonical, self._starts_cache, self._calling, self._live, self._broken = {}, {}, None, None, None
        self._layouts, self._holder = {}, {}
        for key in d.get("layouts", list(d["algorithm_states"])):  # checkpoints before layouts: the states'
            self._hold(tuple(key))
        self.layout_states = {}
        for key, st in kept.items():
            st.residual = None
            if tuple(key) in self._layouts:
                self.layout_states[tuple(key)] = st
        saved = d["residuals"]
        for key, st in self.layout_states.items():  # re-attach residuals to the saved layouts
            here = [saved[i] for i in key if i in saved]
            if st.error_feedback and here:  # (else they wait, and the layout's next call adds them)
                st.residual = torch.cat([saved[i] if i in saved else here[0].new_zeros(self._numel[i]) for i in key])
        placed = {i for key, st in self.layout_states.items() if st.error_feedback for i in key}
        self._memory.parked = {i: r.clone() for i, r in saved.items() if i not in placed}
        self._memory.carry.load(d.get("carried", {}))
        self._staged_last = [tuple(o) for o in d.get("staged", [])]
        orders = d.get("orders")
        self._orders_last = None if orders is None else [tuple(o) for o in orders]
        self._memory.scale.value = d.get("scale")
        self._resumed = True

    def _check_checkpoint(self, d: dict) -> None:
        """Refuse a checkpoint of another model (see :meth:`load_state_dict`)."""
        n = len(self._numel)
        for what, tensors in (("residual", d["residuals"]), ("carried result", d.get("carried", {}))):
            for i, r in tensors.items():
                if not (isinstance(i, int) and 0 <= i < n):
                    raise ValueError(f"SparseHookState.load_state_dict: the checkpoint holds a {what} for "
                                     f"parameter {i!r}; this model has {n} parameters (a checkpoint of another "
                                     "model?)")
                if r.numel() != self._numel[i]:
                    raise ValueError(f"SparseHookState.load_state_dict: the checkpoint's {what} for parameter "
                                     f"{i} has {r.numel()} elements; this model's has {self._numel[i]} (a "
                                     "checkpoint of another model?)")
        seen: set = set()
        for key in list(d["algorithm_states"]) + list(d.get("layouts", [])) + list(d.get("orders") or []):
            bad = [i for i in key if not (isinstance(i, int) and 0 <= i < n)]
            if bad:
                raise ValueError(f"SparseHookState.load_state_dict: a saved bucket holds parameter(s) {bad}; "
                                 f"this model has {n} parameters (a checkpoint of another model?)")
        for key in d.get("layouts", []):
            if seen & set(key):
                raise ValueError(f"SparseHookState.load_state_dict: the saved layouts share parameter(s) "
                                 f"{sorted(seen & set(key))} (not a checkpoint of SparseHookState.state_dict?)")
            seen |= set(key)
