"""The communication cost model of the paper's Sec. 5 ("Performance
analysis"), as a function and a command.

With N parameters of s bits, p workers, transfer time beta per bit (1 /
bandwidth), compression c = parameters / elements sent (what chainer_vgc
reports), e bits per sent element (32: one word each) and pipelining block
m bits:

* dense ring allreduce:           T_r = 2 (p - 1) N s beta / p
* pipelined ring allgatherv:      T_v <= (N e p / c + (p - 1) m) beta
* speedup T_r / T_v, which tends to 2 (p - 1) c s / (p**2 e) as m -> 0, so
  with s = e the exchange gets faster than dense allreduce once c > p / 2.
  (The paper writes T_v with N s p / c, c then being the ratio of bits,
  which is the same thing when s = e = 32.)

Latency terms are ignored, as in the paper.

    python -m chainer_vgc.costmodel --params 15e6 --workers 4 \\
        --compression 400 --bandwidth 1Gbit

:func:`two_tier` extends it to nodes of k ranks joined by one slower link
each (the layout of a hierarchical exchange, issue 27), and ``--table``
prints it for p = 8 ... 1024 and k = 4, 8.
"""

import argparse
import collections
import re

Cost = collections.namedtuple(
    'Cost', ['allreduce_s', 'allgatherv_s', 'speedup', 'speedup_bound'])

_UNITS = {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9, 't': 1e12}


def parse_bandwidth(text):
    """'1Gbit', '10gbit/s', '100Mbit', '1e9' -> bits per second."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r'\s*([0-9.eE+-]+)\s*([kKmMgGtT]?)(bit|b|bps)?'
                         r'(/s)?\s*', str(text))
        if not m:
            raise ValueError('bandwidth {!r}: use bits per second, e.g. '
                             '1Gbit, 10Gbit, 100Mbit or 1e9'.format(text))
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value > 0:
        raise ValueError('bandwidth must be positive, got {!r}'.format(text))
    return value


def _check(params, workers, compression, bits_per_param, bits_per_element,
           chunk_bits=0):
    """ValueError naming the first input out of range."""
    for ok, need, got in ((float(params) > 0, 'params > 0', params),
                          (int(workers) >= 1, 'workers >= 1', workers),
                          (float(compression) > 0, 'compression > 0',
                           compression),
                          (bits_per_param > 0, 'bits_per_param > 0',
                           bits_per_param),
                          (bits_per_element > 0, 'bits_per_element > 0',
                           bits_per_element),
                          (chunk_bits >= 0, 'chunk >= 0', chunk_bits)):
        if not ok:
            raise ValueError('cost model: need {}, got {!r}'.format(need,
                                                                    got))


def cost(params, workers, compression, bandwidth, bits_per_param=32,
         chunk_bits=0, bits_per_element=32):
    """Sec. 5 times (seconds) for one exchange; see the module doc.

    ``compression``: parameters / elements sent per worker;
    ``bits_per_param``: s, of the dense gradient (16, 32, 64);
    ``bits_per_element``: e, on the wire (32 for chainer_vgc's words)."""
    _check(params, workers, compression, bits_per_param, bits_per_element,
           chunk_bits)
    n, p, c = float(params), int(workers), float(compression)
    beta = 1.0 / parse_bandwidth(bandwidth)
    s, e = float(bits_per_param), float(bits_per_element)
    t_r = 2 * (p - 1) * n * s * beta / p
    t_v = (n * e * p / c + (p - 1) * chunk_bits) * beta
    bound = 2 * (p - 1) * c * s / (p ** 2 * e)
    return Cost(t_r, t_v, t_r / t_v if t_v else float('inf'), bound)



def ring_step_times(workers, sent_bits, dense_bits, bandwidth,
                    latency=0.0):
    """(T_v, T_r), seconds, of one step on a ring of ``workers`` ranks,
    with a ``latency`` per message (the dense fallback's prediction,
    :mod:`chainer_vgc.exchange.fallback`): the pipelined allgatherv of
    messages of ``sent_bits`` each on average, ``(p - 1) (L + bits /
    B)`` (each rank receives the other p - 1), and the ring allreduce of
    ``dense_bits``, ``2 (p - 1) (L + dense_bits / (p B))``.  With L = 0
    these are :func:`cost`'s T_r and, with p - 1 for its bound's p,
    its T_v."""
    p, beta = int(workers), 1.0 / parse_bandwidth(bandwidth)
    t_v = (p - 1) * (latency + sent_bits * beta)
    t_r = 2 * (p - 1) * (latency + dense_bits * beta / p)
    return t_v, t_r

TwoTier = collections.namedtuple(
    'TwoTier', ['flat_s', 'hierarchical_s', 'dense_s',
                'dense_hierarchical_s', 'inter_bits_flat',
                'inter_bits_hierarchical'])


def two_tier(params, workers, ranks_per_node, compression, bandwidth,
             intra_bandwidth, bits_per_param=32, bits_per_element=32):
    """Predicted exchange times (seconds) on p ranks in nodes of k, fast
    links inside a node (``intra_bandwidth``) and one link per node
    between them (``bandwidth``), which every ring leaving the node
    shares.  Ring collectives, each as slow as its busiest link, no
    latency, as Sec. 5; q = p / k nodes:

    * flat VGC, a ring allgatherv over p ranks placed node by node: each
      node's link carries the p - 1 other messages of N e / c bits:
      ``(p - 1) N e / c`` (Sec. 5's ``N e p / c`` is its upper bound); on
      one node (q = 1) the ring runs on the fast links;
    * hierarchical VGC (issue 27): g and s reduce-scattered inside the
      node, ``2 (k - 1) / k N s`` over the fast links; k rings of q ranks,
      one per 1/k shard, share the node's link: ``(q - 1) N e / c``; the
      decoded means allgathered inside the node, ``(k - 1) / k N s``;
    * dense, a ring allreduce over p ranks: ``2 (p - 1) / p N s``;
    * dense hierarchical (ChainerMN's two_dimensional): reduce-scatter
      and allgather inside the node, k allreduce rings of shards across:
      ``2 (k - 1) / k N s`` fast, ``2 (q - 1) / q N s`` across.

    ``compression`` c is one worker's, taken to be the same for a node
    acting as one worker of batch kB (its lower variance lets more
    elements pass, so c may shift).  Also returned: the bits on a node's
    link, flat and hierarchical (their ratio is (q - 1) / (p - 1))."""
    p, k = int(workers), int(ranks_per_node)
    if k < 1 or p < 1 or p % k:
        raise ValueError('two_tier: workers must be a multiple of '
                         'ranks_per_node >= 1, got {!r} and {!r}'.format(
                             workers, ranks_per_node))
    _check(params, p, compression, bits_per_param, bits_per_element)
    n, c, q = float(params), float(compression), p // k
    s, e = float(bits_per_param), float(bits_per_element)
    inter = 1.0 / parse_bandwidth(bandwidth)
    intra = 1.0 / parse_bandwidth(intra_bandwidth)
    bits_flat = (p - 1) * n * e / c
    bits_hier = (q - 1) * n * e / c
    inside = (k - 1) / float(k) * n * s * intra
    # a flat ring's busiest link: between nodes when it has more than one
    ring = max(inter if q > 1 else 0.0, intra if k > 1 else 0.0)
    return TwoTier(
        flat_s=bits_flat * ring,
        hierarchical_s=3 * inside + bits_hier * inter,
        dense_s=2 * (p - 1) / float(p) * n * s * ring,
        dense_hierarchical_s=2 * inside + 2 * (q - 1) / float(q) * n * s
        * inter,
        inter_bits_flat=bits_flat, inter_bits_hierarchical=bits_hier)


def table(params, compression, bandwidth, intra_bandwidth,
          ranks_per_node=(4, 8), workers=(8, 16, 32, 64, 128, 256, 512,
                                          1024), **kw):
    """:func:`two_tier` over ``workers`` x ``ranks_per_node``, as lines of
    a Markdown table."""
    lines = ['| p | k | flat VGC s | hierarchical VGC s | dense s | '
             'dense hierarchical s | fastest |',
             '|---:|---:|---:|---:|---:|---:|---|']
    names = ('flat VGC', 'hierarchical VGC', 'dense', 'dense hierarchical')
    for p in workers:
        for k in ranks_per_node:
            t = two_tier(params, p, k, compression, bandwidth,
                         intra_bandwidth, **kw)
            times = t[:4]
            lines.append('| {} | {} | {} | {} |'.format(
                p, k, ' | '.join('{:.4g}'.format(x) for x in times),
                names[times.index(min(times))]))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(
        description='Sec. 5 cost model: dense ring allreduce vs pipelined '
        'ring allgatherv of compressed gradients')
    ap.add_argument('--params', type=float, required=True,
                    help='number of parameters N')
    ap.add_argument('--workers', type=int, help='p (not with --table)')
    ap.add_argument('--compression', type=float, required=True,
                    help='compression ratio c: parameters / elements sent '
                    'per worker (vgc/compression)')
    ap.add_argument('--bandwidth', required=True,
                    help='link bandwidth, e.g. 1Gbit, 10Gbit, 1e9 (bit/s)')
    ap.add_argument('--bits-per-param', type=float, default=32,
                    help='s, bits per parameter of the dense gradient (32 '
                    'for float32, 16 for float16)')
    ap.add_argument('--bits-per-element', type=float, default=32,
                    help='e, bits per sent element on the wire (32: one '
                    'word each)')
    ap.add_argument('--chunk', type=float, default=0,
                    help='pipelining block m in bytes (chainer_vgc ring: '
                    '262144)')
    ap.add_argument('--table', action='store_true',
                    help='nodes: flat and hierarchical VGC, dense and dense '
                    'hierarchical, for p = 8 ... 1024 and --ranks-per-node '
                    '(--bandwidth: between nodes)')
    ap.add_argument('--ranks-per-node', type=int, nargs='+', default=[4, 8],
                    help='k, with --table (default 4 8)')
    ap.add_argument('--intra-bandwidth', default='100Gbit',
                    help='links inside a node, with --table (default '
                    '100Gbit)')
    args = ap.parse_args(argv)
    if args.table:
        print('N = {:,.0f} parameters, c = {:g}, between nodes {:g} bit/s, '
              'inside {:g} bit/s'.format(
                  args.params, args.compression,
                  parse_bandwidth(args.bandwidth),
                  parse_bandwidth(args.intra_bandwidth)))
        lines = table(args.params, args.compression, args.bandwidth,
                      args.intra_bandwidth, tuple(args.ranks_per_node),
                      bits_per_param=args.bits_per_param,
                      bits_per_element=args.bits_per_element)
        print('\n'.join(lines))
        return lines
    if args.workers is None:
        ap.error('--workers is required (or --table)')
    r = cost(args.params, args.workers, args.compression, args.bandwidth,
             args.bits_per_param, 8 * args.chunk, args.bits_per_element)
    print('N = {:,.0f} parameters x {:g} bits, p = {}, c = {:g} (elements), '
          '{:g} bits per element, bandwidth {:g} bit/s, m = {:,.0f} bytes'
          .format(args.params, args.bits_per_param, args.workers,
                  args.compression, args.bits_per_element,
                  parse_bandwidth(args.bandwidth), args.chunk))
    print('dense ring allreduce      T_r = 2(p-1)Ns*beta/p      = {:.6g} s'
          .format(r.allreduce_s))
    print('pipelined ring allgatherv T_v <= (Nep/c+(p-1)m)*beta = {:.6g} s'
          .format(r.allgatherv_s))
    print('speedup T_r / T_v = {:.4g}  (bound for m -> 0: 2(p-1)cs/(p^2 e) '
          '= {:.4g})'.format(r.speedup, r.speedup_bound))
    return r


if __name__ == '__main__':
    main()
