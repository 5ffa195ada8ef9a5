"""Reporting arithmetic against figures computed by hand (no MPI)."""

import numpy
import pytest

from chainer_vgc import codec
from chainer_vgc import communicator
from chainer_vgc import GradientCompressor


def _message(n_words_body, tensor_id=0):
    """A message of one FMT_POW2 group with n elements (2 + 5 + n words)."""
    words = numpy.arange(n_words_body, dtype=numpy.uint32)
    return codec.pack([codec.pow2_group(tensor_id, words, 0)])


def test_step_figures_by_hand():
    # 3 ranks send 10, 20 and 0 elements: messages of 17, 27 and 2 words
    blocks = [_message(10), _message(20), codec.pack([])]
    fig = communicator.step_figures(blocks, n_params=600)
    # elements per rank: 30 / 3 = 10; compression 600 / 10
    assert fig['vgc/compression'] == 60.0
    assert fig['vgc/density'] == pytest.approx(1 / 60)
    # the ring: each rank sends (p - 1) / p of all 46 words, 4 bytes each
    assert fig['vgc/bytes'] == pytest.approx(2 / 3 * 46 * 4)
    assert fig['_elements'] == 30
    # dense float32 ring allreduce: 2 (p - 1) / p * 4 N
    assert fig['_dense_bytes'] == pytest.approx(2 * 2 / 3 * 4 * 600)


def test_dense_bytes_follow_the_gradient_dtypes():
    comp = GradientCompressor('vgc', ['a', 'b', 'c'], [(10,), (5,), (3,)],
                              [numpy.float16, numpy.float32, numpy.float64])
    assert comp.n_bytes == 10 * 2 + 5 * 4 + 3 * 8
    totals = communicator.new_totals()
    blocks = [_message(1), _message(2)]
    communicator.report_step(blocks, comp.n_params, totals, None,
                             comp.n_bytes)
    communicator.report_step(blocks, comp.n_params, totals, [1, 2],
                             comp.n_bytes)
    assert totals['steps'] == 2 and totals['elements'] == 6
    assert totals['dense_bytes'] == pytest.approx(2 * 2 * (1 / 2) * 64)
    assert totals['bytes'] == pytest.approx(2 * (1 / 2) * 4 * (8 + 9))
