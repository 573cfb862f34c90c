"""Device-side digit choice shared by the Triton and CuPy radix selects (torch only).

A radix select finds the k-th largest key digit by digit, most significant
first. Each pass histograms one 8-bit digit of the keys that still match the
prefix chosen so far; :func:`choose_digit` then picks the digit holding the
k-th largest, with torch ops on the device (no host round trip between
passes), and :func:`radix_kth_largest_torch` is the same select written with
torch ops only: the reference the kernels are tested against.
"""

from __future__ import annotations

import torch

from . import dispatch

__all__ = ["key_layout", "choose_digit", "key_to_float", "radix_select", "radix_prefix", "radix_kth_largest_torch"]


def key_layout(dtype: torch.dtype) -> tuple[int, list[int], torch.dtype]:
    """(key bits, digit shifts from the top, same-width int dtype) for a float dtype."""
    if dtype in (torch.float16, torch.bfloat16):
        return 16, [8, 0], torch.int16
    if dtype == torch.float32:
        return 32, [24, 16, 8, 0], torch.int32
    raise ValueError(f"radix select supports float16/bfloat16/float32, got {dtype}")


def choose_digit(hist: torch.Tensor, krem: torch.Tensor, prefix: torch.Tensor) -> None:
    """Pick the digit holding the ``krem``-th largest; update ``krem`` and ``prefix`` in place.

    1. above[d] = number of matching keys with digit >= d (a reversed cumsum).
    2. The digit is the largest d with above[d] >= krem.
    3. krem -= keys with a larger digit; prefix = prefix * 256 + d.
    """
    h = hist.to(torch.int64)
    above = torch.flip(torch.cumsum(torch.flip(h, [0]), 0), [0])
    d = (above >= krem).sum() - 1
    # gather, not above[tensor]: indexing with a device scalar reads it on the host (a sync per digit).
    larger = torch.where(d < 255, above.gather(0, (d + 1).clamp(max=255).reshape(1))[0], torch.zeros_like(d))
    krem.sub_(larger)
    prefix.mul_(256).add_(d.to(prefix.dtype))


def radix_select(x: torch.Tensor, k: int, histogram, choose=None) -> float:
    """Exact k-th largest of |x| by :func:`radix_prefix`, then its one read."""
    return key_to_float(dispatch.to_host(radix_prefix(x, k, histogram, choose)), x.dtype)


def _choose(hist: torch.Tensor, krem: torch.Tensor, prefix: torch.Tensor, prefix32: torch.Tensor) -> None:
    """:func:`choose_digit` in torch ops, then the next digit's int32 prefix and a zeroed histogram."""
    choose_digit(hist, krem, prefix)
    prefix32.copy_(prefix.reshape(1))
    hist.zero_()


def radix_prefix(x: torch.Tensor, k: int, histogram, choose=None) -> torch.Tensor:
    """Exact k-th largest of |x| by an 8-bit radix select, given a device histogram kernel.

    1. For each digit (most significant first), ``histogram(x, n, prefix32,
       hist, bits, shift, first)`` counts the digit of the keys matching the
       prefix chosen so far into ``hist`` (256 int32 bins).
    2. ``choose(hist, krem, prefix, prefix32)`` picks the digit on the device (no sync
       between passes), sets the int32 prefix the next histogram matches and zeroes
       ``hist`` for it: :func:`choose_digit` in torch ops by default, one kernel on Triton.

    Shared by the Triton and CuPy paths, which differ in the histogram launch.
    Returns the k-th largest key as an int64 device scalar (nothing read).
    """
    bits, shifts, _ = key_layout(x.dtype)
    x = x.reshape(-1).contiguous()
    dev = x.device
    krem = torch.full((), k, dtype=torch.int64, device=dev)  # (a fill: no copy from the host)
    prefix = torch.zeros((), dtype=torch.int64, device=dev)
    prefix32 = torch.zeros(1, dtype=torch.int32, device=dev)
    hist = torch.zeros(256, dtype=torch.int32, device=dev)
    for i, shift in enumerate(shifts):
        histogram(x, x.numel(), prefix32, hist, bits, shift, i == 0)
        (choose or _choose)(hist, krem, prefix, prefix32)
    return prefix


def key_to_float(key: int, dtype: torch.dtype) -> float:
    """The float whose (sign-less) bit pattern is ``key``."""
    bits, _, idt = key_layout(dtype)
    with dispatch.host_side():  # a reinterpretation of a host integer
        return float(torch.tensor([key], dtype=torch.int64).to(idt).view(dtype)[0])


def radix_kth_largest_torch(x: torch.Tensor, k: int) -> float:
    """k-th largest of |x| by 8-bit radix select, with torch ops (the kernels' reference).

    1. keys = bit patterns of x without the sign (ordered like |x|).
    2. Per digit, most significant first: histogram the digit over keys
       matching the prefix, :func:`choose_digit`.
    3. The final prefix is the k-th largest key.
    """
    bits, shifts, idt = key_layout(x.dtype)
    mask = (1 << (bits - 1)) - 1
    keys = x.reshape(-1).view(idt).to(torch.int64) & mask
    krem = torch.tensor(k, dtype=torch.int64, device=x.device)
    prefix = torch.zeros((), dtype=torch.int64, device=x.device)
    for i, shift in enumerate(shifts):
        match = keys if i == 0 else keys[(keys >> (shift + 8)) == prefix]
        hist = torch.bincount((match >> shift) & 255, minlength=256)
        choose_digit(hist, krem, prefix)
    return key_to_float(dispatch.to_host(prefix), x.dtype)
