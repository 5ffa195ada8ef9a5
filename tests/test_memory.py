"""What vgc holds in memory, by role, on a model of known sizes
(``GradientCompressor.memory``, ``PerSampleSquares.memory``: what
benchmarks/bench_memory.py reports), and that the statistics do not keep
the last backward's graph alive between steps."""

import gc
import os
import subprocess
import sys
import weakref

import chainer
import chainer.functions as F
import numpy

from chainer_vgc import GradientCompressor
from chainer_vgc.harness.models import MLP
from chainer_vgc.params import model_params
from chainer_vgc.statistics import PerSampleSquares


def _model():
    numpy.random.seed(0)
    model = MLP((7, 5), 3)
    x = numpy.random.rand(4, 6).astype(numpy.float32)
    model(x)
    return model, x


def test_every_byte_held_is_accounted_for_by_role():
    """An MLP of 6-7-5-3 (n = 49 + 40 + 18 = 107 float32 parameters): the
    statistics hold s (4n bytes) and their workspace; vgc on the native
    backend holds r and v (8n), with spare_residuals=True the spare r and v
    (8n), and a message buffer of the largest message (4 bytes a word: the
    wire format's longest message of this model)."""
    model, x = _model()
    names, params = model_params(model)
    n = sum(p.size for p in params)
    assert n == 6 * 7 + 7 + 7 * 5 + 5 + 5 * 3 + 3 == 107
    hook = PerSampleSquares(model)
    assert hook.memory() == {'sums': 0, 'workspace': 0}
    model.cleargrads()
    sums = hook.backward(F.sum(model(x) ** 2), batch=(x,))
    mem = hook.memory()
    assert mem['sums'] == 4 * n == sum(s.nbytes for s in sums)
    assert mem['workspace'] == hook.work.nbytes

    comps = [GradientCompressor('vgc', names, [p.shape for p in params],
                                [p.dtype for p in params], backend='native',
                                alpha=1.0, spare_residuals=spare)
             for spare in (False, True)]
    for spare, comp in zip((False, True), comps):
        assert comp.memory() == {'residuals': 0, 'spare_residuals': 0,
                                 'message': 0}
        comp.compress([p.grad for p in params], sums)
        got = comp.memory()
        # the largest message by the wire format (docs/wire_format.md):
        # its 2-word header, and for each of the 6 tensors a 5-word group
        # header and, every element sent, one FMT_POW2 word each (fixed
        # indices: each tensor is small), counted here, not by the code
        words = 2 + 6 * 5 + n
        # in place (the default) no spare set; with spares, r and v again
        assert got == {'residuals': 8 * n,
                       'spare_residuals': 8 * n if spare else 0,
                       'message': 4 * words}, (spare, got)
    # the NumPy backend keeps no spare set and no buffer of its own
    ref = GradientCompressor('vgc', names, [p.shape for p in params],
                             [p.dtype for p in params], backend='numpy',
                             alpha=1.0)
    ref.compress([p.grad for p in params], sums)
    assert ref.memory() == {'residuals': 8 * n, 'spare_residuals': 0,
                            'message': 0}


def test_the_statistics_drop_the_graph_after_the_backward():
    """The hook forgets the function nodes of its pass: they hold the
    graph, and the activations it retains, until the next step (ResNet-50:
    300 MB more than the plain run at batch 4; docs/benchmarks.md)."""
    model, x = _model()
    hook = PerSampleSquares(model)
    for _ in range(2):  # (the second pass, with the hook's buffers made)
        model.cleargrads()
        y = model(x)
        node = weakref.ref(y.creator_node)  # the last Linear's
        hook.backward(F.sum(y ** 2), batch=(x,))
        del y
        gc.collect()
        assert node() is None
    assert chainer.config.train


def test_the_benchmark_accounts_for_the_extra_memory():
    """benchmarks/bench_memory.py on the demo's MLP, one step: every role
    printed, and what vgc holds beyond 'none' is those roles within a
    tenth of the parameter bytes ('other')."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(root, 'benchmarks', 'bench_memory.py'),
         '--model', 'mlp', '--steps', '1'], check=True, capture_output=True,
        text=True, timeout=300).stdout
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()
            if ln.startswith('  ')}
    for role in ('residuals', 'spare', 'message', 'sums', 'workspace',
                 'other'):
        assert role in rows, out
    assert float(rows['residuals'][3].rstrip('x')) == 2.0, out
    # the communicator's default: residuals updated in place, no spares
    assert float(rows['spare'][3].rstrip('x')) == 0.0, out
    assert abs(float(rows['other'][3].rstrip('x'))) < 0.1, out
