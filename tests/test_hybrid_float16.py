"""Hybrid with float16 parameters and Chainer's dynamic loss scaling trains
like float32 hybrid (issue 24, finding 5), with real mpiexec runs of
tests/mpi/check_hybrid_float16.py."""

import pytest

from mpirun import run_ok

# multi-rank runs oversubscribe the cores: under pytest-xdist they run one
# after the other, on one worker, beside the single-process tests
pytestmark = pytest.mark.xdist_group('mpiexec')


@pytest.mark.parametrize('p', [2, 4])
def test_hybrid_float16_trains_like_float32(p):
    """In the issue's setting (64-128-10 MLP, Adam 1e-3, the loss times
    512, Adam without ``use_fp32_update()``) and in
    check_nonfinite.train_scaled's (an overflow provoked, with and without
    ``use_fp32_update()``): every training loss finite, no parameter
    element moves by more than Adam's step, and the held-out loss and
    accuracy are within 0.05-0.1 and 0.03 of float32 hybrid's.  Without
    float32 updates, Adam's float16 v underflows for the tau / p sized
    means and max |param| jumps to 16."""
    run_ok(p, 'check_hybrid_float16.py',
           expect='hybrid float16 OK at p={}'.format(p), timeout=180)
