"""Sparse allreduce algorithms, one per module; importing this package registers them."""

from .cltk import CltkState, cltk
from .dense import DenseState, dense
from .gaussiank import GaussiankState, gaussiank
from .gtopk import GTopkState, gtopk
from .oktopk import OkTopkState, oktopk
from .oktopk_grid import OkTopkGridState, oktopk2d
from .oktopk_twolevel import OkTopkTwoLevelState, oktopk2l
from .topka import TopkAState, topka
from .topkdsa import TopkDSAState, topkdsa

__all__ = ["OkTopkState", "oktopk", "OkTopkGridState", "oktopk2d", "OkTopkTwoLevelState", "oktopk2l",
           "TopkAState", "topka", "TopkDSAState", "topkdsa",
           "GTopkState", "gtopk", "GaussiankState", "gaussiank", "DenseState", "dense", "CltkState", "cltk"]
