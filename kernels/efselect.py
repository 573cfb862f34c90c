"""Fused error-feedback select: accumulate, threshold, compact into COO, in one pass;
and the fused accumulate of dense error feedback (``ef_accumulate``).

``ef_select`` replaces the torch chain ``r += s*g; m = |r| >= th; idx =
nonzero(m); val = r[idx]; r[idx] = 0`` (five passes and three temporaries)
with one pass that reads g and r, writes r, and writes only the selected
entries. :func:`ef_select_torch` is that chain, kept as the reference.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from . import dispatch
from .estimate import bucketize

__all__ = ["ef_select", "ef_select_torch", "ef_select_counted", "Selected", "tally", "tally_torch", "ef_accumulate",
           "ef_accumulate_torch", "shares_memory"]


def _check(grad: torch.Tensor, residual: torch.Tensor, capacity: int,
           out_idx: torch.Tensor | None, out_val: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if residual.dim() != 1 or not residual.is_contiguous():
        raise ValueError("ef_select: residual must be a contiguous 1-D tensor (it is written in place)")
    if residual.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"ef_select: residual must be float32 or float64, got {residual.dtype}")
    if grad.numel() != residual.numel() or grad.device != residual.device:
        raise ValueError("ef_select: grad and residual must have the same size and device")
    if not grad.is_floating_point():
        raise ValueError(f"ef_select: grad must be floating point, got {grad.dtype}")
    if capacity < 0:
        raise ValueError(f"ef_select: capacity must be >= 0, got {capacity}")
    dev = residual.device
    if out_idx is None:
        out_idx = torch.empty(capacity, dtype=torch.int64, device=dev)
    if out_val is None:
        out_val = torch.empty(capacity, dtype=residual.dtype, device=dev)
    if (out_idx.numel() < capacity or out_val.numel() < capacity or out_idx.dtype != torch.int64
            or out_val.dtype != residual.dtype or not (out_idx.is_contiguous() and out_val.is_contiguous())):
        raise ValueError("ef_select: out_idx/out_val must be contiguous int64 / residual-dtype "
                         "buffers of at least `capacity` entries")
    return grad.reshape(-1).contiguous(), out_idx, out_val


def ef_select_torch(grad: torch.Tensor, residual: torch.Tensor, threshold: float, capacity: int,
                    scale: float, zero_selected: bool, out_idx: torch.Tensor,
                    out_val: torch.Tensor, zero_out: torch.Tensor | None = None,
                    device_counts: bool = False) -> "int | tuple[torch.Tensor, torch.Tensor | None]":
    """The reference: the unfused torch chain with the same contract as :func:`ef_select`.

    ``device_counts``: read nothing; return the count and the non-finite count as device
    scalars (the backends' common form for :func:`ef_select_counted`; the GPU kernels give
    None for the second, which :func:`tally` then counts).
    """
    if zero_out is not None:
        zero_out.zero_()
    acc = residual.add(grad.to(residual.dtype), alpha=scale)
    finite = torch.isfinite(acc)
    mask = ~finite | ((acc.abs() >= threshold) & (acc != 0))
    residual.copy_(torch.where(finite, acc, residual))
    if device_counts:
        return _select_on_device(acc, finite, mask, capacity, zero_selected, residual, out_idx, out_val)
    idx = torch.nonzero(mask).flatten()
    count = idx.numel()
    w = min(count, capacity)
    out_idx[:w] = idx[:w]
    out_val[:w] = acc[idx[:w]]
    if zero_selected and w:
        residual.index_fill_(0, idx[:w][finite[idx[:w]]], 0)
    return count


def _select_on_device(acc: torch.Tensor, finite: torch.Tensor, mask: torch.Tensor, capacity: int,
                      zero_selected: bool, residual: torch.Tensor, out_idx: torch.Tensor,
                      out_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's outputs with no read: the first ``capacity`` selected positions
    (``nonzero_static``, padded past the count), and the counts as device scalars."""
    n = acc.numel()
    if capacity:
        pos = torch.nonzero_static(mask, size=capacity, fill_value=n).flatten()
        valid = pos < n
        out_idx[:capacity] = pos
        out_val[:capacity] = torch.where(valid, acc.index_select(0, pos.clamp(max=max(n - 1, 0))),
                                         torch.zeros((), dtype=acc.dtype, device=acc.device))
    if zero_selected:  # the written finite entries (a scatter of the positions would repeat the padding's)
        residual.masked_fill_(mask & finite & (torch.cumsum(mask, 0) <= capacity), 0)
    return mask.sum(), finite.numel() - finite.sum()


def tally(values: torch.Tensor, count: torch.Tensor, capacity: int, rungs: torch.Tensor | None = None,
          nonfinite: torch.Tensor | None = None, *, backend: str | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Everything the host needs from a fused select's buffer, packed into one int64 vector.

    1. The first min(count, capacity) of ``values`` are kept; past them a value counts as 0.
    2. words[0] = count; words[1] = kept values that are not finite (``nonfinite`` where
       the select counted them already).
    3. With ``rungs`` (ascending, positive, ``values``' dtype): each entry's bucket
       (``kernels.bucketize``: the rungs it is not below, NaN above all) and words[2 + j]
       = entries at or above rung j.
    4. With ``rungs``, words[-1] = the bits of the largest |value| (NaN if one is), as an
       integer of the values' width (:func:`_from_bits` turns it back into the float); else 0.

    On a GPU that is one kernel, and the vector one read (``ef_select_counted``).

    Args:
        values: the select's value buffer, float32/float64, at least ``capacity`` long.
        count: the select's true count, a device scalar (nothing is read).
        capacity: entries the buffer holds.
        rungs: a 1-D tensor of at most 16 rungs, or None.
        nonfinite: the select's own count of non-finite sums (a device scalar), or None.

    Returns:
        ``(words, bucket)``: 3 + len(rungs) int64 words, and the int64 buckets of the
        ``capacity`` entries (None without rungs).
    """
    if rungs is not None and not (rungs.dim() == 1 and rungs.numel() <= 16 and rungs.dtype == values.dtype):
        raise ValueError("tally: rungs must be a 1-D tensor of at most 16 entries of the values' dtype")
    return _TALLY(values, count, int(capacity), rungs, nonfinite, backend=backend)


def tally_torch(values: torch.Tensor, count: torch.Tensor, capacity: int, rungs: torch.Tensor | None,
                nonfinite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference of :func:`tally`."""
    dev = values.device
    valid = torch.arange(capacity, device=dev) < count
    kept = values[:capacity]
    if nonfinite is None:
        nonfinite = (valid & ~torch.isfinite(kept)).sum()
    parts = [count.reshape(1).to(torch.int64), nonfinite.reshape(1).to(torch.int64)]
    if rungs is None:
        return torch.cat(parts + [torch.zeros(1, dtype=torch.int64, device=dev)]), None
    mag = torch.where(valid, kept.abs(), torch.zeros((), dtype=values.dtype, device=dev))
    top = mag.amax(0, keepdim=True) if capacity else torch.zeros(1, dtype=values.dtype, device=dev)
    bucket, hist = bucketize(mag, rungs)
    bits = top.view(torch.int32 if values.element_size() == 4 else torch.int64)
    return torch.cat(parts + [hist.flip(0).cumsum(0).flip(0)[1:], bits.to(torch.int64)]), bucket


def _from_bits(word: int, dtype: torch.dtype) -> float:
    """The float whose bits (of ``dtype``'s width, non-negative) are ``word``."""
    if dtype == torch.float32:
        return struct.unpack("<f", struct.pack("<i", word))[0]
    return struct.unpack("<d", struct.pack("<q", word))[0]


_TALLY = dispatch.KernelOp("tally", tally_torch, cpu="numba_backend:tally", triton="triton_backend:tally",
                          accepts={"cpu": lambda values, *_: values.dtype in (torch.float32, torch.float64)})


def ef_select(grad: torch.Tensor, residual: torch.Tensor, threshold: float, capacity: int,
              scale: float = 1.0, zero_selected: bool = True, *,
              out_idx: torch.Tensor | None = None, out_val: torch.Tensor | None = None,
              zero_out: torch.Tensor | None = None, nonfinite: bool = False,
              backend: str | None = None) -> tuple:
    """Error-feedback accumulate and select in one pass over memory.

    1. acc = residual + scale * grad, computed in the residual's dtype and
       written back into ``residual`` where it is finite.
    2. Selected: acc != 0 and |acc| >= threshold (threshold <= 0 selects
       every nonzero entry), and every entry whose acc is not finite (NaN,
       Inf, or a sum that overflows): those keep their old residual.
    3. The first ``capacity`` selected entries, by ascending index, are
       written as (int64 index, value) into ``out_idx``/``out_val``; later
       ones are counted but not written.
    4. If ``zero_selected``, the written finite entries become 0 in
       ``residual`` (they were sent); overflowing entries keep acc, so
       nothing is lost.
    5. ``zero_out``, if given, is set to all zeros: the dense output a
       sparse call then fills with O(k) writes (numba does it in the pass;
       the GPU paths, and on CPU 16-bit or not 32-byte-aligned outputs, in a
       pass of its own).

    Step 2's rule is the finite check of the input, folded into this pass:
    when ``count <= capacity`` the output alone (O(k)) says whether the
    gradient was finite, and since a non-finite sum never reaches
    ``residual``, a caller that must reject the call can subtract the
    gradient back out (``State.rollback``) without having lost any entry.

    Args:
        grad: gradient, any float dtype (fp16/bf16/fp32/fp64), any shape with
            ``residual.numel()`` elements, same device.
        residual: contiguous 1-D float32/float64 error-feedback memory,
            updated in place.
        threshold: magnitude threshold.
        capacity: entries the output buffers hold.
        scale: multiplies grad (e.g. a learning rate or 1/P).
        zero_selected: zero the written entries in ``residual``.
        out_idx, out_val: preallocated buffers (allocated when None).
        zero_out: a contiguous tensor of ``residual.numel()`` floats on the
            same device, sharing no memory with grad or residual.
        nonfinite: also return how many sums were not finite (None when the
            buffers overflowed), read from the device with the count: on a GPU
            one synchronisation for both.
        backend: ``torch``/``triton``/``cupy``/``cpu``/``auto`` (see
            ``kernels.dispatch``); default: ``SPARSECOMM_KERNELS`` or auto.

    Returns:
        ``(out_idx, out_val, count)``: the buffers and the TRUE number of
        selected entries; the first ``min(count, capacity)`` are valid.
        With ``nonfinite``: ``(out_idx, out_val, count, nonfinite)``.

    Example::

        idx, val, c = ef_select(g, r, th, capacity=2 * k)
        idx, val = idx[:min(c, 2 * k)], val[:min(c, 2 * k)]
    """
    grad, out_idx, out_val = _check(grad, residual, capacity, out_idx, out_val)
    if zero_out is not None:
        _check_zero_out(zero_out, grad, residual)
    if nonfinite:
        got = _counted(grad, residual, threshold, capacity, scale, zero_selected, out_idx, out_val, zero_out,
                       None, backend)
        return out_idx, out_val, got.count, got.nonfinite
    count = _EF_SELECT(grad, residual, float(threshold), int(capacity), float(scale), bool(zero_selected),
                       out_idx, out_val, zero_out, False, backend=backend)
    return out_idx, out_val, count


@dataclass
class Selected:
    """What :func:`ef_select_counted` gives the host, from one read of the device.

    ``indexes``/``values``: the buffers (the first ``min(count, capacity)`` valid);
    ``count``: the true number selected; ``nonfinite``: sums that were not finite (None
    when the buffers overflowed). With ``rungs``: ``above[j]``, the kept candidates at or
    above rung j; ``top``, the largest kept magnitude; ``bucket``, per buffer entry the
    number of rungs at or below its magnitude (``kernels.bucketize``), on the device.
    """

    indexes: torch.Tensor
    values: torch.Tensor
    count: int
    nonfinite: int | None
    above: list[int] | None = None
    top: float | None = None
    bucket: torch.Tensor | None = None


def ef_select_counted(grad: torch.Tensor, residual: torch.Tensor, threshold: float, capacity: int,
                      scale: float = 1.0, zero_selected: bool = True, *, rungs: torch.Tensor | None = None,
                      out_idx: torch.Tensor | None = None, out_val: torch.Tensor | None = None,
                      zero_out: torch.Tensor | None = None, backend: str | None = None) -> Selected:
    """:func:`ef_select` with one read of the device for everything the host needs next.

    1. The fused pass (every backend), its count and non-finite count left on the device.
    2. With ``rungs`` (ascending magnitudes, the candidates' dtype, on their device): each
       kept candidate's bucket, the counts at or above each rung and the largest kept
       magnitude, on the device (O(capacity)).
    3. One read of all of them (on a GPU, the call's one synchronisation so far).
    """
    grad, out_idx, out_val = _check(grad, residual, capacity, out_idx, out_val)
    if zero_out is not None:
        _check_zero_out(zero_out, grad, residual)
    return _counted(grad, residual, threshold, capacity, scale, zero_selected, out_idx, out_val, zero_out, rungs,
                    backend)


def _counted(grad: torch.Tensor, residual: torch.Tensor, threshold: float, capacity: int, scale: float,
             zero_selected: bool, out_idx: torch.Tensor, out_val: torch.Tensor, zero_out: torch.Tensor | None,
             rungs: torch.Tensor | None, backend: str | None) -> Selected:
    count, bad = _EF_SELECT(grad, residual, float(threshold), int(capacity), float(scale), bool(zero_selected),
                            out_idx, out_val, zero_out, True, backend=backend)
    words, bucket = tally(out_val, count, capacity, rungs, bad, backend=_tally_backend(backend))
    got = dispatch.to_host(words)  # the one read
    n, nonfinite = got[0], got[1]
    selected = Selected(out_idx, out_val, n, nonfinite if n <= capacity else None)
    if rungs is not None:
        selected.above, selected.top, selected.bucket = got[2:-1], _from_bits(got[-1], out_val.dtype), bucket
    return selected


def _tally_backend(backend: str | None) -> str | None:
    """The tally's backend for an ef_select asked for ``backend``: Triton's if it was, else the
    usual choice (it has no CuPy or numba path)."""
    return backend if backend in ("triton", "torch") else None


def _check_zero_out(zero_out: torch.Tensor, grad: torch.Tensor, residual: torch.Tensor) -> None:
    if (zero_out.numel() != residual.numel() or zero_out.device != residual.device
            or not zero_out.is_floating_point() or not zero_out.is_contiguous()):
        raise ValueError("ef_select: zero_out must be a contiguous float tensor of residual.numel() "
                         "elements on the residual's device")
    if shares_memory(zero_out, grad) or shares_memory(zero_out, residual):
        raise ValueError("ef_select: zero_out must not share memory with grad or residual "
                         "(the pass still reads them)")


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of ``a`` and ``b`` (first to last element, strides included) overlap."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _positive_threshold(grad, residual, threshold, *_) -> bool:
    # The numba loop decides by not |acc| < th alone, right only for th > 0 in
    # the residual's dtype (a float32 threshold below 7e-46 rounds to 0).
    # "Every nonzero entry" is the reference's acc != 0 test: comparing |acc|
    # with the smallest subnormal instead would select zeros under
    # torch.set_flush_denormal.
    return bool((np.float32(threshold) if residual.dtype == torch.float32 else np.float64(threshold)) > 0)


# Every path has every dtype; cpu takes only positive thresholds.
_EF_SELECT = dispatch.KernelOp(
    "ef_select", ef_select_torch, on=1, cpu="numba_backend:ef_select",
    triton="triton_backend:ef_select", cupy="cupy_backend:ef_select",
    accepts={"cpu": _positive_threshold}, prefer=dispatch.CUDA_SCANS)


# ---- dense error feedback: accumulate, and the block maxima a quantiser's scales need -------
#: Entries per step of the torch chain: its temporaries stay this small (GPUs without Triton
#: run it for every accumulation).
TORCH_CHUNK = 1 << 22


def ef_accumulate_torch(grad: torch.Tensor, residual: torch.Tensor, block: int, maxima: torch.Tensor) -> torch.Tensor:
    """The reference: the unfused torch chain with the same contract as :func:`ef_accumulate`
    (the count left on the device, as a 0-dim int64)."""
    bad = torch.zeros((), dtype=torch.int64, device=residual.device)
    for lo in range(0, residual.numel(), TORCH_CHUNK):
        r = residual[lo:lo + TORCH_CHUNK]
        acc = r + grad[lo:lo + TORCH_CHUNK].to(residual.dtype)
        finite = torch.isfinite(acc)
        r.copy_(torch.where(finite, acc, r))
        bad += (~finite).sum()
    if block:  # 0: no maxima
        padded = torch.zeros(maxima.numel() * block, dtype=residual.dtype, device=residual.device)
        padded[:residual.numel()] = residual.abs()
        maxima.copy_(padded.view(-1, block).amax(dim=1))
    return bad


def ef_accumulate(grad: torch.Tensor, residual: torch.Tensor, block: int | None = 4096, *,
                  backend: str | None = None, lazy: bool = False) -> tuple[torch.Tensor | None, int | torch.Tensor]:
    """Error-feedback accumulate with the largest magnitude of every block, in one pass.

    1. acc = residual + grad, computed in the residual's dtype and written
       back into ``residual`` where it is finite (as :func:`ef_select`: a
       non-finite sum leaves its entry, so a rejected call can take the
       gradient back out, ``State.rollback``).
    2. maxima[b] = max |residual| over entries [b * block, (b + 1) * block),
       after step 1 (the last block may be short); none with ``block=None``.
    3. The count of non-finite sums: the input's finite check, folded in.

    What a dense quantising allreduce needs before it encodes: the max |acc|
    of any chunk (its scale) from the maxima of the blocks inside it and the
    few entries at its edges, instead of a pass over acc per call, and the
    finite check, instead of a pass over the gradient. Without maxima it is
    the plain accumulation of every other state, with its finite check folded
    in and no overflowing sum ever written into the residual.

    Args:
        grad: gradient, any float dtype, ``residual.numel()`` elements, same device.
        residual: contiguous 1-D float32/float64 error-feedback memory, updated in place.
        block: entries per maximum (>= 1), or None for no maxima.
        backend: ``torch``/``triton``/``cpu``/``auto`` (``kernels.dispatch``;
            Triton takes blocks that are powers of two from 128 to 16384).
        lazy: leave the count on the device (a 0-dim int64) where it is there, for the
            caller to read with whatever else it reads (an int from the CPU path).

    Returns:
        ``(maxima, nonfinite)``: ``ceil(n / block)`` maxima in the residual's
        dtype (None without a block), and how many sums were not finite.
    """
    if residual.dim() != 1 or not residual.is_contiguous() or residual.dtype not in (torch.float32, torch.float64):
        raise ValueError("ef_accumulate: residual must be a contiguous 1-D float32/float64 tensor "
                         f"(it is written in place), got {residual.dtype} of shape {tuple(residual.shape)}")
    if grad.numel() != residual.numel() or grad.device != residual.device or not grad.is_floating_point():
        raise ValueError("ef_accumulate: grad must be floating point, with the residual's size and device")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"ef_accumulate: block must be an integer >= 1 or None, got {block!r}")
    b = block or 0  # 0: no maxima, as the implementations take it
    maxima = torch.empty(-(-residual.numel() // b) if b else 0, dtype=residual.dtype, device=residual.device)
    nonfinite = _EF_ACCUMULATE(grad.reshape(-1).contiguous(), residual, b, maxima, backend=backend)
    if isinstance(nonfinite, torch.Tensor) and not lazy:
        nonfinite = int(dispatch.to_host(nonfinite))
    return (maxima if block else None), nonfinite


def _power_of_two_block(grad, residual, block, *_) -> bool:
    # A Triton program covers one block of maxima: a power of two (tl.arange), and small
    # enough for one program's registers.
    return block == 0 or (block & (block - 1) == 0 and 128 <= block <= 16384)


_EF_ACCUMULATE = dispatch.KernelOp("ef_accumulate", ef_accumulate_torch, on=1, cpu="numba_backend:ef_accumulate",
                                   triton="triton_backend:ef_accumulate", accepts={"triton": _power_of_two_block})
