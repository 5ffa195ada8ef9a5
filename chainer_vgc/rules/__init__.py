"""Compression rules: ``vgc``, ``hybrid``, ``strom``, ``qsgd``, ``dgc``,
``powersgd``, ``none``."""

from chainer_vgc.rules.base import CompressionRule  # NOQA
from chainer_vgc.rules.dgc import DGC
from chainer_vgc.rules.hybrid import Hybrid
from chainer_vgc.rules.none import NoCompression
from chainer_vgc.rules.powersgd import PowerSGD
from chainer_vgc.rules.qsgd import QSGD
from chainer_vgc.rules.strom import Strom
from chainer_vgc.rules.vgc import VGC

RULES = {cls.name: cls for cls in (VGC, Hybrid, Strom, QSGD, DGC,
                                   PowerSGD, NoCompression)}


def create_rule(method, **kwargs):
    """Rule object for ``method`` with its hyperparameters.

    Unknown methods and arguments raise ValueError naming the valid ones.
    """
    try:
        cls = RULES[method]
    except KeyError:
        raise ValueError('unknown compression method {!r}; choose one of {}'
                         .format(method, ', '.join(sorted(RULES))))
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError('method {!r}: {}'.format(method, e))
