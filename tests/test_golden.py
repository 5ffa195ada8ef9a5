"""Every backend's messages equal the ones recorded in
tests/data/golden_messages.npz (before the issue-13 restructuring): the
wire format and the rules' numerics changed by no byte."""

import numpy
import pytest

import golden_messages as golden

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack


@pytest.mark.parametrize('backend', ['numpy', 'native'])
@pytest.mark.parametrize('k', range(len(golden.CASES)))
def test_messages_equal_the_recorded_ones(backend, k):
    method, kw = golden.CASES[k]
    recorded = numpy.load(golden.PATH)
    got = golden.messages(method, kw, backend)
    assert len(got) == golden.STEPS
    for step, m in enumerate(got):
        want = recorded[golden.key(k, step)]
        assert m.dtype == numpy.uint32 and numpy.array_equal(m, want), (
            method, kw, step)


@pytest.mark.parametrize('backend', ['numpy', 'native'])
@pytest.mark.parametrize('k', range(len(golden.RESTART_CASES)))
def test_restart_table_messages_equal_the_recorded_ones(backend, k):
    """FMT_GAP groups of more than 1,024 elements (issue 25's restart
    tables), recorded when the table was introduced; FMT_SPARSE's (dgc,
    issue 51) when it was."""
    from chainer_vgc import codec
    from chainer_vgc.codec.message import walk
    method, kw = golden.RESTART_CASES[k]
    recorded = numpy.load(golden.PATH)
    got = golden.messages(method, kw, backend, restarts=True)
    tables = 0
    for step, m in enumerate(got):
        want = recorded[golden.key(k, step, restarts=True)]
        assert m.dtype == numpy.uint32 and numpy.array_equal(m, want), (
            method, kw, step)
        sizes = [int(numpy.prod(s)) for s in golden.RESTART_SHAPES]
        tables += sum(codec.gap_restarts(g.count) for g in walk(m, sizes)
                      if g.fmt in (codec.FMT_GAP, codec.FMT_SPARSE))
    assert tables > 0  # the cases do carry restart points
