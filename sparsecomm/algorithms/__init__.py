"""Sparse allreduce algorithms, one per module; importing this package registers them."""

from .oktopk import OkTopkState, oktopk

__all__ = ["OkTopkState", "oktopk"]
