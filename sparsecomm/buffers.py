"""The buffers a State keeps between calls, so that a steady-state call allocates nothing of size n.

Three kinds, all transient (a checkpoint carries none; a loaded state makes its own):
scratch buffers that their users leave all zero, workspaces whose contents are
undefined between uses, and the result buffers a plain call (no ``out=``) writes
into, taken only when nothing else in the process reads them.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["BufferPool"]


def _storage_users(buf: torch.Tensor) -> tuple[int, int]:
    """(the use count of ``buf``'s storage, the references to its Python storage object):
    what tensors and storage objects elsewhere in this process hold it. Host-side
    bookkeeping only: no device read."""
    storage = buf.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


class BufferPool:
    """Persistent buffers by name, and up to ``limit`` result buffers.

    Args:
        limit: how many result buffers :meth:`result_buffer` may keep.
    """

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self.scratch_buffers: dict[str, torch.Tensor] = {}
        self.workspace_buffers: dict[str, torch.Tensor] = {}
        #: (buffer, its storage's users when nothing else held it)
        self.results: list[tuple[torch.Tensor, tuple[int, int]]] = []

    def scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A persistent all-zero buffer; whoever uses it leaves it all zero again (O(k) resets).

        Steady-state calls then allocate nothing of size n: a fresh 100 MB
        ``torch.zeros`` costs ~56 ms of page faults at 25M elements, five
        times the add the call is measured against. Not saved in checkpoints.
        """
        bufs = self.scratch_buffers
        buf = bufs.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = bufs[name] = torch.zeros(numel, dtype=dtype, device=device)
        return buf

    def result_buffer(self, like: torch.Tensor) -> torch.Tensor | None:
        """A tensor shaped like ``like`` for a plain call's result, on a buffer the state keeps.

        A fresh n-element result costs n/1024 minor page faults a call on CPU (the
        allocator maps large blocks anew each time: ~3x the rest of a steady Ok-Topk
        call at 25M), and CUDA graphs want fixed addresses. So the state keeps up to
        ``limit`` flat buffers and hands out a *view* of one that nobody else
        uses:

        1. A buffer is free when its storage has no user besides the state's own
           tensor: every tensor the caller can hold that reads it (the returned view,
           views of it, ``.grad`` set to it, a tensor autograd saved, a NumPy array
           or DLPack capsule of it) is a tensor of its own on the same storage and
           counts in the storage's use count, and a storage object taken from it
           counts in that object's references. A returned result is therefore never
           overwritten while anything in this process can still read it.
        2. A buffer moved to shared memory (sent to another process) leaves the set:
           the other process's reads count nowhere here.
        3. Else, below the limit, a new buffer joins the set (its pages are faulted
           in once); else None, and the caller allocates a fresh tensor, as without
           a state. Under ``torch.inference_mode()`` always None (an inference
           tensor would then come back from later ordinary calls).

        Buffers are dropped when the tensor's size, dtype or device changes, and are
        never saved in checkpoints. They cost up to two n-element tensors per state
        for the state's life. On CUDA the set knows nothing of
        ``Tensor.record_stream``: hold the result until other streams are done with it.
        """
        if (not hasattr(torch._C, "_storage_Use_Count") or torch.is_inference_mode_enabled()
                or like.layout != torch.strided
                or like.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64)):
            return None
        n = like.numel()
        pool = self.results
        if pool and (pool[0][0].numel() != n or pool[0][0].dtype != like.dtype or pool[0][0].device != like.device):
            pool.clear()
        pool[:] = [(buf, idle) for buf, idle in pool if not buf.is_shared()]
        for buf, idle in pool:
            if _storage_users(buf) == idle:
                return buf.view(like.shape)
        if len(pool) >= self.limit:
            return None
        buf = torch.empty(n, dtype=like.dtype, device=like.device)
        pool.append((buf, _storage_users(buf)))  # the counts with no other user, as this torch reports them
        return buf.view(like.shape)

    def buffers(self) -> list[torch.Tensor]:
        """The persistent buffers (scratch and workspace) this state holds."""
        return [*self.scratch_buffers.values(), *self.workspace_buffers.values()]

    def workspace(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A persistent buffer whose contents are undefined between uses (not saved in checkpoints)."""
        bufs = self.workspace_buffers
        buf = bufs.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = bufs[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf
