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


def cost(params, workers, compression, bandwidth, bits_per_param=32,
         chunk_bits=0, bits_per_element=32):
    """Sec. 5 times (seconds) for one exchange; see the module doc.

    ``compression``: parameters / elements sent per worker;
    ``bits_per_param``: s, of the dense gradient (16, 32, 64);
    ``bits_per_element``: e, on the wire (32 for chainer_vgc's words)."""
    n, p, c = float(params), int(workers), float(compression)
    for ok, need, got in ((n > 0, 'params > 0', params),
                          (p >= 1, 'workers >= 1', workers),
                          (c > 0, 'compression > 0', compression),
                          (bits_per_param > 0, 'bits_per_param > 0',
                           bits_per_param),
                          (bits_per_element > 0, 'bits_per_element > 0',
                           bits_per_element),
                          (chunk_bits >= 0, 'chunk >= 0', chunk_bits)):
        if not ok:
            raise ValueError('cost model: need {}, got {!r}'.format(need,
                                                                    got))
    beta = 1.0 / parse_bandwidth(bandwidth)
    s, e = float(bits_per_param), float(bits_per_element)
    t_r = 2 * (p - 1) * n * s * beta / p
    t_v = (n * e * p / c + (p - 1) * chunk_bits) * beta
    bound = 2 * (p - 1) * c * s / (p ** 2 * e)
    return Cost(t_r, t_v, t_r / t_v if t_v else float('inf'), bound)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description='Sec. 5 cost model: dense ring allreduce vs pipelined '
        'ring allgatherv of compressed gradients')
    ap.add_argument('--params', type=float, required=True,
                    help='number of parameters N')
    ap.add_argument('--workers', type=int, required=True, help='p')
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
    args = ap.parse_args(argv)
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
