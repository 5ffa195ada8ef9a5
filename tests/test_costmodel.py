"""Sec. 5 cost model against values computed by hand."""

import subprocess
import sys

import pytest

from chainer_vgc import costmodel


def test_hand_computed_example():
    # N = 25e6 float32, p = 4, c = 100, 1 Gbit/s, m = 0:
    # T_r = 2*3*25e6*32/4 / 1e9 = 1.2 s; T_v = 25e6*32*4/100 / 1e9 = 0.032 s
    r = costmodel.cost(25e6, 4, 100, '1Gbit')
    assert r.allreduce_s == pytest.approx(1.2)
    assert r.allgatherv_s == pytest.approx(0.032)
    assert r.speedup == pytest.approx(37.5)
    assert r.speedup_bound == pytest.approx(2 * 3 * 100 / 16)  # = 37.5


def test_chunk_term_and_bound():
    # m = 1 MiB = 8388608 bits, p = 8, c = 1000, 10 Gbit/s, N = 1e7:
    # T_r = 2*7*1e7*32/8 / 1e10 = 0.056
    # T_v = (1e7*32*8/1000 + 7*8388608) / 1e10 = (2560000 + 58720256)/1e10
    r = costmodel.cost(1e7, 8, 1000, '10Gbit', chunk_bits=8388608)
    assert r.allreduce_s == pytest.approx(0.056)
    assert r.allgatherv_s == pytest.approx(61280256 / 1e10)
    assert r.speedup == pytest.approx(0.056 / (61280256 / 1e10))
    assert r.speedup < r.speedup_bound == pytest.approx(2 * 7 * 1000 / 64)


def test_linear_speedup_starts_at_c_over_p_half():
    # bound 2(p-1)c/p^2 > 1  <=>  c > p^2 / (2(p-1)) ~ p/2
    for p in (2, 4, 16):
        c = p * p / (2 * (p - 1))
        assert costmodel.cost(1e6, p, c, 1e9).speedup == pytest.approx(1.0)


@pytest.mark.parametrize('text,bits', [('1Gbit', 1e9), ('10gbit/s', 1e10),
                                       ('100Mbit', 1e8), ('1e9', 1e9),
                                       (2.5e9, 2.5e9)])
def test_parse_bandwidth(text, bits):
    assert costmodel.parse_bandwidth(text) == bits


def test_compression_counts_elements_not_bits():
    """c is parameters / elements sent (what the communicator reports); a
    float16 gradient (s = 16) halves T_r but not the 32-bit words of T_v:
    N = 25e6, p = 4, c = 100: T_v = 25e6*32*4/100 / 1e9 = 0.032 s either
    way, T_r = 2*3*25e6*16/4 / 1e9 = 0.6 s, bound 2*3*100*16/(16*32)."""
    r = costmodel.cost(25e6, 4, 100, '1Gbit', bits_per_param=16)
    assert r.allgatherv_s == pytest.approx(0.032)
    assert r.allreduce_s == pytest.approx(0.6)
    assert r.speedup_bound == pytest.approx(2 * 3 * 100 * 16 / (16 * 32))
    # 16-bit words on the wire halve T_v
    assert costmodel.cost(25e6, 4, 100, '1Gbit',
                          bits_per_element=16).allgatherv_s == \
        pytest.approx(0.016)
    out = subprocess.run(
        [sys.executable, '-m', 'chainer_vgc.costmodel', '--help'],
        capture_output=True, text=True, check=True, timeout=60).stdout
    assert 'parameters / elements sent' in out and '--bits-per-element' in out


@pytest.mark.parametrize('kw,match', [
    (dict(workers=0), 'workers >= 1'),
    (dict(compression=0), 'compression > 0'),
    (dict(bits_per_param=0), 'bits_per_param > 0'),
    (dict(bits_per_element=-1), 'bits_per_element > 0'),
    (dict(chunk_bits=-8), 'chunk >= 0'),
    (dict(params=0), 'params > 0'),
])
def test_bad_input(kw, match):
    with pytest.raises(ValueError, match='bandwidth'):
        costmodel.parse_bandwidth('fast')
    args = dict(params=1e6, workers=4, compression=10, bandwidth='1Gbit')
    args.update(kw)
    with pytest.raises(ValueError, match=match) as info:
        costmodel.cost(**args)
    # the whole message: the argument's condition and the value given
    (value,) = kw.values()
    assert str(info.value) == 'cost model: need {}, got {!r}'.format(
        match, value)
    for bad in (0, -1e9, '0Gbit'):
        with pytest.raises(ValueError, match='bandwidth must be positive, '
                           'got {!r}'.format(bad)):
            costmodel.cost(1e6, 4, 10, bad)


def test_command_line():
    out = subprocess.run(
        [sys.executable, '-m', 'chainer_vgc.costmodel', '--params', '25e6',
         '--workers', '4', '--compression', '100', '--bandwidth', '1Gbit'],
        capture_output=True, text=True, check=True, timeout=60).stdout
    assert 'T_r = 2(p-1)Ns*beta/p      = 1.2 s' in out
    assert 'T_v <= (Nep/c+(p-1)m)*beta = 0.032 s' in out
    assert 'speedup T_r / T_v = 37.5' in out


def test_two_tier_by_hand():
    """p = 16 in nodes of k = 4 (q = 4), N = 1e7, c = 100, 1 Gbit/s
    between nodes, 100 Gbit/s inside, s = e = 32:
    flat     (p-1) N e / c / 1e9 = 15 * 1e7 * 32 / 100 / 1e9 = 0.048
    hier.    3 * 3/4 * 1e7 * 32 / 1e11 + 3 * 1e7 * 32 / 100 / 1e9
             = 0.0072 + 0.0096 = 0.0168
    dense    2 * 15/16 * 1e7 * 32 / 1e9 = 0.6
    dense h. 2 * 3/4 * 1e7 * 32 / 1e11 + 2 * 3/4 * 1e7 * 32 / 1e9
             = 0.0048 + 0.48 = 0.4848"""
    t = costmodel.two_tier(1e7, 16, 4, 100, '1Gbit', '100Gbit')
    assert t.flat_s == pytest.approx(0.048)
    assert t.hierarchical_s == pytest.approx(0.0168)
    assert t.dense_s == pytest.approx(0.6)
    assert t.dense_hierarchical_s == pytest.approx(0.4848)
    # a node's link carries (q - 1) / (p - 1) of the flat bits
    assert t.inter_bits_hierarchical / t.inter_bits_flat == \
        pytest.approx(3 / 15)


def test_two_tier_limits():
    """k = 1: every rank is a node, hierarchical = flat, and flat and
    dense are Sec. 5's ring figures with p - 1 for p.  q = 1: one node,
    nothing crosses a node's link, every ring runs on the fast links."""
    t = costmodel.two_tier(25e6, 4, 1, 100, '1Gbit', '100Gbit')
    assert t.hierarchical_s == pytest.approx(t.flat_s)
    assert t.dense_hierarchical_s == pytest.approx(t.dense_s)
    flat = costmodel.cost(25e6, 4, 100, '1Gbit')
    assert t.dense_s == pytest.approx(flat.allreduce_s)
    assert t.flat_s == pytest.approx(flat.allgatherv_s * 3 / 4)
    one = costmodel.two_tier(25e6, 8, 8, 100, '1Gbit', '100Gbit')
    assert one.inter_bits_hierarchical == 0
    assert one.flat_s == pytest.approx(7 * 25e6 * 32 / 100 / 1e11)
    assert one.dense_s == pytest.approx(2 * 7 / 8 * 25e6 * 32 / 1e11)
    with pytest.raises(ValueError, match='multiple of ranks_per_node'):
        costmodel.two_tier(25e6, 6, 4, 100, '1Gbit', '100Gbit')


def test_table_command_prints_every_p_and_k():
    out = subprocess.run(
        [sys.executable, '-m', 'chainer_vgc.costmodel', '--params', '14.5e6',
         '--compression', '239', '--bandwidth', '1Gbit', '--table'],
        capture_output=True, text=True, check=True).stdout
    rows = [ln for ln in out.splitlines() if ln.startswith('| ') and
            ln[2].isdigit()]
    assert [tuple(r.split('|')[1:3]) for r in rows] == [
        (' {} '.format(p), ' {} '.format(k))
        for p in (8, 16, 32, 64, 128, 256, 512, 1024) for k in (4, 8)]
    # at p = 1024, k = 8 the hierarchical exchange is the fastest
    assert rows[-1].rstrip(' |').endswith('hierarchical VGC')


def test_ring_step_times_by_hand():
    """The dense fallback's prediction (costmodel.ring_step_times), worked
    by hand: p = 4 ranks, 1,000-bit messages, a 32,000-bit model, 1 kbit/s,
    0.5 s a message: T_v = 3 (0.5 + 1) = 4.5 s, T_r = 6 (0.5 + 8) = 51 s;
    without latency its T_r is Sec. 5's (cost's) for the same model."""
    assert costmodel.ring_step_times(4, 1000, 32000, '1kbit', 0.5) == \
        (4.5, 51.0)
    t_v, t_r = costmodel.ring_step_times(4, 1000, 1000 * 32, 1e3)
    assert (t_v, t_r) == (3.0, 48.0)
    assert t_r == costmodel.cost(1000, 4, 10, 1e3).allreduce_s
