#!/usr/bin/env python
"""What the reference FMT_GAP decoder (``codec.gap_decode_body``, the NumPy
path and the native path's fault finder) costs on corrupt and on valid
bodies: time and peak memory (tracemalloc, which sees NumPy's buffers and
Python's objects alike).

- corrupt: a body of ``--mb`` MB claiming one element, its stream all-ones
  words (issue 24, finding 6: the decoder expanded every bit of it before
  looking at the stream's length);
- valid: ``--count`` elements spread over a tensor of ``--size`` (the
  decoder's ordinary work, to compare speed before and after a change).

    python benchmarks/bench_gap_decode.py [--mb 1] [--count 100000]
"""

import argparse
import time
import tracemalloc

import numpy

from chainer_vgc import codec


def corrupt_body(mb):
    """param k = 0, G, G all-ones stream words, one value word: a body of
    about ``mb`` MB for a group of count 1."""
    g = (mb << 20) // 4 - 3
    body = numpy.full(g + 3, 0xFFFFFFFF, dtype=numpy.uint32)
    body[0], body[1], body[-1] = 0, g, 0
    return body


def valid_body(count, size):
    rng = numpy.random.default_rng(0)
    index = numpy.sort(rng.choice(size, count, replace=False))
    nibbles = rng.integers(0, 16, count).astype(numpy.uint8)
    return codec.gap_body(index, nibbles, codec.rice_parameter(count, size),
                          False)


def measure(body, count, size):
    """(seconds: the best of 3, peak bytes, outcome) of a decode."""
    def decode():
        try:
            index, nibbles = codec.gap_decode_body(body, count, size)
            return 'accepted, output {:.2f} MB'.format(
                (index.nbytes + nibbles.nbytes) / 2 ** 20)
        except codec.WireFormatError as e:
            return 'refused: ' + str(e).split(': ', 1)[1]
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        outcome = decode()
        seconds.append(time.perf_counter() - start)
    seconds = min(seconds)
    tracemalloc.start()
    decode()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, outcome


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--mb', type=int, default=1)
    parser.add_argument('--count', type=int, default=100000)
    parser.add_argument('--size', type=int, default=10 ** 7)
    args = parser.parse_args()
    cases = [('corrupt, {} MB, count 1'.format(args.mb),
              corrupt_body(args.mb), 1, 10 ** 9),
             ('valid, count {}, size {}'.format(args.count, args.size),
              valid_body(args.count, args.size), args.count, args.size)]
    for name, body, count, size in cases:
        seconds, peak, outcome = measure(body, count, size)
        print('{}: body {:.2f} MB, {:.4f} s, peak {:.2f} MB ({:.2f}x the '
              'body); {}'.format(name, body.nbytes / 2 ** 20, seconds,
                                 peak / 2 ** 20, peak / body.nbytes,
                                 outcome))


if __name__ == '__main__':
    main()
