"""Every backend's messages equal the ones recorded in
tests/data/golden_messages.npz (before the issue-13 restructuring): the
wire format and the rules' numerics changed by no byte."""

import numpy
import pytest

import golden_messages as golden


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
