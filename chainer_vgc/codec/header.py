"""The group header and what every format shares: :class:`Group` (one
tensor's part of a message: header fields and body words),
:class:`WireFormat` (one entry of the table of formats), the error a
receiver raises, and the checks every checked decoder applies."""

import collections

import numpy


class WireFormatError(ValueError):
    """A received message is truncated, corrupt or from another model."""


Group = collections.namedtuple(
    'Group', ['tensor_id', 'fmt', 'count', 'a', 'b', 'body', 'span'],
    defaults=(0,))
Group.__doc__ = (
    'One tensor\'s part of a message (or, FMT_GAP, a span of tensors): the '
    'header fields and the body words '
    '(built by the ``*_group`` functions for :func:`.pack`; a view of the '
    'received message when read back; ``span``: the further tensors a '
    'FMT_GAP group covers, as read back).')

Decoded = collections.namedtuple('Decoded', ['tensor_id', 'index', 'value'])

# Each format's functions take a Group ``g`` read from a message (``g.body``:
# its body words, host or device):
#   body_words(g, head)        body length in words, from the header and
#                              ``head``: the first body words present (at
#                              most GAP_PARAM_WORDS; fewer if truncated)
#   check(g, size)             header checks (``size``: the receiving tensor's
#                              elements, a FMT_GAP span's total, None when
#                              unknown)
#   decode(g, size, dtype, xp) (index, value in ``dtype``), every word and
#                              value checked (:func:`.unpack`; None: FMT_GAP,
#                              which unpack decodes and splits itself)
#   values(g, size, dtype, xp) (index or None when the group is dense, value
#                              in ``dtype`` or as sent), nothing checked and
#                              nothing read back (:func:`.add_validated`;
#                              None: FMT_GAP, expanded first by expand_gap)

WireFormat = collections.namedtuple(
    'WireFormat', ['code', 'name', 'a', 'b', 'body', 'body_words', 'check',
                   'decode', 'values'])
WireFormat.__doc__ = ('One wire format: its code and name, the meaning of '
                      'header fields ``a``, ``b`` and of the body, and its '
                      'functions (see the comment above this class).')


def where(g):
    """The start of an error message about group ``g``."""
    return 'chainer_vgc wire message, group for tensor {}: '.format(
        g.tensor_id)


def no_check(g, size):
    """The header check of a format with nothing to check."""


def f32_bits(x):
    """The float32 bits of ``x`` as an int (a header word)."""
    return int(numpy.array(x, dtype=numpy.float32).view(numpy.uint32))


def check_finite(value, wire, g, dtype, xp):
    """``value`` (what the decoder writes, in the state ``dtype``) must be
    finite; ``wire`` (the values as sent, or None) tells a non-finite value
    on the wire from one that overflows ``dtype``."""
    if bool(xp.isfinite(value).all()):
        return
    if wire is not None and not bool(xp.isfinite(wire).all()):
        raise WireFormatError(where(g) + 'non-finite value')
    raise WireFormatError(where(g) + 'value out of range for {}'.format(
        numpy.dtype(dtype)))


def check_index(index, size, g):
    """Indices must be in range and strictly increasing (senders emit them
    sorted and unique; a duplicate would silently lose an addition)."""
    if index.size > 1 and not bool((index[1:] > index[:-1]).all()):
        raise WireFormatError(where(g) + 'indices not strictly increasing '
                              '(duplicate or unsorted)')
    # increasing, so the last index is the largest
    if index.size and int(index[-1]) >= size:
        raise WireFormatError(where(g) + 'index {} out of range for a tensor '
                              'of {} elements'.format(int(index[-1]), size))
