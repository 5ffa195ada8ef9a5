"""Reporting arithmetic against figures computed by hand (no MPI; the
per-parameter report runs a one-rank communicator in a subprocess)."""

import os

import numpy
import pytest

from chainer_vgc import codec
from chainer_vgc import reporting
from chainer_vgc import GradientCompressor


def _message(n_words_body, tensor_id=0):
    """A message of one FMT_POW2 group with n elements (2 + 5 + n words)."""
    words = numpy.arange(n_words_body, dtype=numpy.uint32)
    return codec.pack([codec.pow2_group(tensor_id, words, 0)])


def test_step_figures_by_hand():
    # 3 ranks send 10, 20 and 0 elements: messages of 17, 27 and 2 words
    blocks = [_message(10), _message(20), codec.pack([])]
    fig = reporting.step_figures(blocks, n_params=600)
    # elements per rank: 30 / 3 = 10; compression 600 / 10
    assert fig['vgc/compression'] == 60.0
    assert fig['vgc/density'] == pytest.approx(1 / 60)
    # the ring: each rank sends (p - 1) / p of all 46 words, 4 bytes each
    assert fig['vgc/bytes'] == pytest.approx(2 / 3 * 46 * 4)
    assert fig['_elements'] == 30
    # dense float32 ring allreduce: 2 (p - 1) / p * 4 N
    assert fig['_dense_bytes'] == pytest.approx(2 * 2 / 3 * 4 * 600)
    # all 46 words of the messages for their 30 elements
    assert fig['vgc/bits_per_element'] == pytest.approx(32 * 46 / 30)


def test_bits_per_element_of_gap_coded_messages_and_over_the_run():
    """The worked example of FMT_GAP: 3 elements in a 4-word body; a step
    that sends nothing reports no ratio; the run total is bits over
    elements, not a mean of ratios; an older snapshot's totals (without
    the message counts) are extended, not broken."""
    gap = codec.pack([codec.pow2_best_group(
        0, numpy.array([1 << 28, 8 << 28, 2 << 28], numpy.uint32),
        numpy.array([3, 4, 40]), 0, 1.0, 100, coding='gap')])
    assert gap.size == 2 + 5 + 4
    fig = reporting.step_figures([gap], n_params=100)
    assert fig['vgc/bits_per_element'] == pytest.approx(32 * 11 / 3)
    assert 'vgc/bits_per_element' not in reporting.step_figures(
        [codec.pack([])], n_params=100)
    totals = reporting.new_totals()
    del totals['message_bits'], totals['message_elements']  # format 2
    for blocks in ([gap], [_message(10)], [codec.pack([])]):
        reporting.report_step(blocks, 100, totals)
    assert totals['message_bits'] == 32 * (11 + 17 + 2)
    assert totals['message_elements'] == 13
    summary = reporting.run_summary(totals, None, 1)
    assert summary['vgc/total_bits_per_element'] == pytest.approx(
        32 * 30 / 13)


def test_dense_bytes_follow_the_gradient_dtypes():
    comp = GradientCompressor('vgc', ['a', 'b', 'c'], [(10,), (5,), (3,)],
                              [numpy.float16, numpy.float32, numpy.float64])
    assert comp.n_bytes == 10 * 2 + 5 * 4 + 3 * 8
    totals = reporting.new_totals()
    blocks = [_message(1), _message(2)]
    reporting.report_step(blocks, comp.n_params, totals, None,
                          comp.n_bytes)
    reporting.report_step(blocks, comp.n_params, totals, [1, 2],
                          comp.n_bytes)
    assert totals['steps'] == 2 and totals['elements'] == 6
    assert totals['dense_bytes'] == pytest.approx(2 * 2 * (1 / 2) * 64)
    assert totals['bytes'] == pytest.approx(2 * (1 / 2) * 4 * (8 + 9))


_BY_PARAMETER = '''
import json, sys, numpy, chainer, chainer.links as L, chainer.functions as F
from chainer import training
import chainer_vgc
method = sys.argv[1]
numpy.random.seed(0)
model = L.Classifier(chainer.Sequential(L.Linear(6, 5), F.relu,
                                        L.Linear(5, 3)))
kw = {'alpha': 1.0} if method == 'vgc' else {}
comm = chainer_vgc.create_communicator(method, **kw)
opt = chainer_vgc.create_multi_node_optimizer(
    chainer.optimizers.SGD(0.1), comm).setup(model)
rng = numpy.random.default_rng(0)
data = chainer.datasets.TupleDataset(
    rng.normal(size=(64, 6)).astype('f'), rng.integers(0, 3, 64).astype('i'))
it = chainer.iterators.SerialIterator(data, 8)
trainer = training.Trainer(training.StandardUpdater(it, opt),
                           (9, 'iteration'), out=sys.argv[2])
log = training.extensions.LogReport(trigger=(3, 'iteration'))
trainer.extend(chainer_vgc.extensions.CompressionReport(
    comm, trigger=(3, 'iteration'), by_parameter=True))
trainer.extend(log)
trainer.run()
st = comm.state(model)
print(json.dumps({'log': log.log, 'counts': st.elements_by_parameter,
                  'totals': st.totals}))
'''


@pytest.mark.parametrize('method', ['none', 'vgc'])
def test_per_parameter_report_of_a_two_layer_model(tmp_path, method):
    """CompressionReport(..., by_parameter=True) on a 2-layer model at one
    rank, 9 iterations (8 exchanges after the broadcast), reports every 3:
    without compression each parameter sends its size every step (shares
    = sizes / total, density 1); with vgc the counts add up to the
    elements the totals counted and the shares to 1."""
    import json
    import subprocess
    import sys
    proc = subprocess.run(
        [sys.executable, '-c', _BY_PARAMETER, method, str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OPENBLAS_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sizes = {'/predictor/0/W': 30, '/predictor/0/b': 5,
             '/predictor/1/W': 15, '/predictor/1/b': 3}
    counts, last = out['counts'], out['log'][-1]
    assert sorted(counts) == sorted(sizes)
    assert sum(counts.values()) == out['totals']['elements']
    shares = {n: last['vgc/share' + n] for n in sizes}
    assert sum(shares.values()) == pytest.approx(1.0)
    if method == 'none':
        assert counts == {n: s * 8 for n, s in sizes.items()}
        for n, s in sizes.items():
            assert shares[n] == pytest.approx(s / 53)
            assert last['vgc/density' + n] == pytest.approx(1.0)
    else:
        assert sum(counts.values()) < 53 * 8
