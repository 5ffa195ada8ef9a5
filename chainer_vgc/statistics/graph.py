"""The computational graph: which function nodes consume each parameter?

Per-example contributions (paper Sec. 4.1) are formed at the function node
that consumes a parameter.  Most layers hand their parameters straight to
their function (``F.linear(x, W, b)``).  Some first rearrange them:
Chainer's ``NStepLSTM``/``NStepGRU``/``NStepRNN`` (without cuDNN) stack or
concatenate a layer's weights into one matrix per time step before
``F.linear`` (``stack([w2, w0, w1, w3], axis=1)`` and a reshape, for the
LSTM).  A rearrangement only moves elements, so each parameter's gradient
is a selection of the matrix's: :func:`_scan` follows ``stack``,
``concat`` and ``reshape`` from a parameter to the function that computes
with it and records which rows of that function's weight (or bias) the
parameter is (:class:`Selection`).  Which rows of the functions' *inputs*
belong to which example is :mod:`~chainer_vgc.statistics.rows`' question.
"""

import numpy

from chainer.functions.array import concat as _concat
from chainer.functions.array import reshape as _reshape
from chainer.functions.array import stack as _stack
from chainer.functions.connection import linear as _linear


def _functions_of(var):
    """Every function node in the graph of ``var``."""
    seen, out = set(), []
    stack = [var.creator_node] if var.creator_node is not None else []
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        out.append(fn)
        stack.extend(node.creator_node for node in fn.inputs
                     if node.creator_node is not None)
    return out


def _scan(loss, params):
    """The function nodes of loss's graph, and the uses of each of
    ``params``: ``(functions, {index: [(fn, k, selection)]})``: fn consumes
    the parameter as its input k, directly (selection None) or through a
    rearrangement (a :class:`Selection`)."""
    index = {id(p.node): i for i, p in enumerate(params)}
    functions = _functions_of(loss)
    consumers = {}
    for fn in functions:
        for k, node in enumerate(fn.inputs):
            consumers.setdefault(id(node), []).append((fn, k))
    uses = {}
    for p_id, i in index.items():
        for fn, k in consumers.get(p_id, ()):
            uses.setdefault(i, []).extend(
                _followed(fn, k, params[i].shape, consumers))
    return functions, uses


#: the rearranging functions followed from a parameter to its use
_REARRANGING = (_stack.Stack, _concat.Concat, _reshape.Reshape)


class Selection(object):
    """A parameter's place in the input of the function that computes with
    it, after rearrangements (``path``: their class names): ``rows`` the
    rows of that function's weight (or the elements of its bias) the
    parameter's rows are, in order; None when it is not such a selection
    (the use is not covered)."""

    def __init__(self, path, rows):
        self.path = path
        self.rows = rows

    def describe(self, fn):
        return ' -> '.join(self.path + [type(fn).__name__])


def _followed(fn, k, shape, consumers, path=(), positions=None, key=()):
    """The uses ``[(fn, k, selection)]`` reached from input k of ``fn``
    (a parameter of ``shape``, or a rearrangement of one: ``positions``
    the flat place of each of its elements, ``key`` how they were
    computed)."""
    if not isinstance(fn, _REARRANGING):
        if not path:
            return [(fn, k, None)]
        return [(fn, k, Selection(list(path), _row_selection(
            fn, k, shape, positions, key)))]
    out = fn.outputs[0]()
    if out is None:
        return []
    step = (type(fn).__name__, getattr(fn, 'axis', None), k,
            tuple(tuple(n.shape) for n in fn.inputs), tuple(out.shape))
    key = key + (step,)
    positions = _positions(fn, k, out, shape, positions, key)
    found = []
    for nxt, kk in consumers.get(id(out), ()):
        found.extend(_followed(nxt, kk, shape, consumers,
                               path + (type(fn).__name__,), positions, key))
    return found


#: {key: flat positions}, {key: rows}: rearrangements repeat every step
#: (an LSTM stacks its weights again at each time step)
_POSITIONS = {}
_ROWS = {}
_CACHE_LIMIT = 256


def _remember(cache, key, value):
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def _positions(fn, k, out, shape, positions, key):
    """Where each element of the parameter is in ``out``, flat."""
    cached = _POSITIONS.get((shape, key))
    if cached is not None:
        return cached
    if positions is None:
        positions = numpy.arange(int(numpy.prod(shape)))
    if isinstance(fn, _reshape.Reshape):
        moved = positions  # C order is kept
    else:
        places = numpy.arange(int(numpy.prod(out.shape))).reshape(out.shape)
        axis = fn.axis % len(out.shape)
        if isinstance(fn, _stack.Stack):
            mine = numpy.take(places, k, axis=axis)
        else:  # Concat
            sizes = [n.shape[axis] for n in fn.inputs]
            lo = sum(sizes[:k])
            mine = numpy.take(places, numpy.arange(lo, lo + sizes[k]),
                              axis=axis)
        moved = mine.reshape(-1)[positions]
    return _remember(_POSITIONS, (shape, key), moved)


def _row_selection(fn, k, shape, positions, key):
    """The rows of F.linear's weight (k = 1) or bias (k = 2) that the
    parameter's rows are, or None (not Linear, or not whole rows)."""
    cached = _ROWS.get((shape, key, type(fn), k))
    if cached is not None:
        return cached if len(cached) else None
    rows = None
    if isinstance(fn, _linear.LinearFunction) and k in (1, 2):
        target = fn.inputs[k].shape
        if k == 2 and len(shape) == 1 and len(target) == 1:
            rows = positions
        elif k == 1 and len(shape) == 2 and len(target) == 2 and \
                shape[1] == target[1]:
            width = target[1]
            grid = positions.reshape(shape)
            first = grid[:, 0]
            if (numpy.all(first % width == 0) and numpy.array_equal(
                    grid, first[:, None] + numpy.arange(width))):
                rows = first // width
    _remember(_ROWS, (shape, key, type(fn), k),
              rows if rows is not None else numpy.empty(0, numpy.int64))
    return rows
