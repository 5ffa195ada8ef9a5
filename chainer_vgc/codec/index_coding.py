"""The choice of index coding for the elements of FMT_POW2
(``index_coding`` of vgc, hybrid, strom: one of :data:`.CODINGS`): the
paper's fixed 28-bit index (FMT_POW2) or gap codes (FMT_GAP), whichever is
asked for or, with ``'auto'``, shorter."""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.codec.constants import (
    CODINGS, FMT_GAP, GAP_PARAM_WORDS, HEADER_WORDS, INDEX_BITS, MAX_COUNT,
    MAX_INDEX)
from chainer_vgc.codec.gap import gap_body, rice_parameter
from chainer_vgc.codec.header import Group, f32_bits
from chainer_vgc.codec.pow2 import pow2_encode, pow2_group
from chainer_vgc.codec.restarts import gap_restarts


def pow2_max_words(size, coding):
    """Most words (header included) :func:`pow2_best_group` gives for a
    tensor of ``size`` elements.  FMT_GAP's codes take at most
    ``count * (k + 2) + (size - count) / 2**k`` bits (an escape is never
    more than one bit longer than the unary code it replaces), which the
    k of :func:`~chainer_vgc.codec.gap.rice_parameter` keeps below 2.4 bits per tensor element;
    the value fields take at most 4, and the restart table 4 words per
    1,024 elements."""
    fixed = HEADER_WORDS + size
    gap = (HEADER_WORDS + GAP_PARAM_WORDS + 2 + (7 * size + 31) // 32
           + 4 * gap_restarts(size))
    if coding == 'fixed':
        return fixed
    if coding == 'auto' and size <= MAX_INDEX:
        return fixed  # FMT_GAP only when shorter
    return gap


def pow2_best_group(tensor_id, words, index, e_k, scale, size,
                    coding='auto', sign_only=False):
    """The group of FMT_POW2 ``words`` (from :func:`.pow2_encode`; only their
    top 4 bits are read when gap-coded) at ``index`` (sorted, unique,
    int64: any tensor size) of a tensor of ``size`` elements.

    ``coding``: ``'fixed'`` (the paper's word, FMT_POW2), ``'gap'``
    (FMT_GAP) or ``'auto'``: FMT_GAP when its body is shorter, or when
    ``size`` exceeds the 28-bit index (ties go to FMT_POW2).
    ``sign_only``: every d is 0 (Strom, hybrid), one value bit per element.
    """
    if coding not in CODINGS:
        raise ValueError('index_coding must be one of {}, got {!r}'.format(
            CODINGS, coding))
    count = int(words.size)
    if count > MAX_COUNT:
        raise ValueError('{} elements sent from one tensor in one step; the '
                         'wire format carries at most 2**32 - 1'.format(count))
    if coding == 'fixed':
        if size > MAX_INDEX:
            raise ValueError('index_coding=\'fixed\' addresses at most '
                             '2**28 elements per tensor, got {}'.format(size))
        return pow2_group(tensor_id, words, e_k, scale)
    nibbles = words >> numpy.uint32(INDEX_BITS)
    body = gap_body(index, nibbles, rice_parameter(count, size), sign_only)
    if coding == 'auto' and size <= MAX_INDEX and body.size >= count:
        return pow2_group(tensor_id, words, e_k, scale)
    return Group(int(tensor_id), FMT_GAP, count, int(e_k) & 0xFFFFFFFF,
                 f32_bits(scale), body)


def pow2_sign_group(tensor_id, sign, tau, dtype, coding='auto'):
    """The group of ``sign * tau`` (e_k 0, d 0, scale tau: Strom, hybrid)
    for the nonzero entries of ``sign`` (+1, -1, 0), or None when there is
    none; ``dtype`` is the state dtype, ``coding`` as
    :func:`pow2_best_group` (gap-coded: one value bit per element)."""
    xp = arrays.get_array_module(sign)
    index = xp.nonzero(sign)[0]
    if index.size == 0:
        return None
    words, _ = pow2_encode(sign[index].astype(dtype), index, 0)
    return pow2_best_group(tensor_id, words, index, 0, tau, sign.size,
                           coding=coding, sign_only=True)
