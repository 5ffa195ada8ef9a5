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

from chainer_vgc.statistics import pullback
from chainer_vgc.statistics.rows import _derived_from


def _functions_of(var, consumers=None):
    """Every function node in the graph of ``var``; ``consumers`` (a
    dict), when given, receives who consumes each variable node:
    ``{node: [(fn, k)]}`` in the order of the nodes returned (one walk
    for both).  The nodes are keys themselves, not their ``id()``: an
    audit hook (filelock's, which ``import chainer`` installs) runs on
    every ``id()`` call, about 1 us each, and a walk makes thousands."""
    seen, out = set(), []
    first = var.creator_node
    stack = [first] if first is not None else []
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        out.append(fn)
        for k, node in enumerate(fn.inputs):
            if consumers is not None:
                held = consumers.get(node)
                if held is None:
                    consumers[node] = [(fn, k)]
                else:
                    held.append((fn, k))
            creator = node.creator_node
            if creator is not None and creator not in seen:
                stack.append(creator)
    return out


def _scan(loss, params, batch_ids=()):
    """The function nodes of loss's graph, the uses of each of ``params``
    and who consumes each variable node: ``(functions, {index: [(fn, k,
    selection)]}, {node: [(fn, k)]})``: fn consumes
    the parameter as its input k, directly (selection None), through a
    rearrangement into rows of a Linear (a :class:`Selection`) or through
    other functions of itself and constants (a
    :class:`~chainer_vgc.statistics.pullback.Pullback`).  ``batch_ids``:
    the ids of the minibatch's arrays (an input that is neither one of
    them, nor computed, nor a parameter is a constant)."""
    index = {p.node: i for i, p in enumerate(params)}
    consumers = {}
    functions = _functions_of(loss, consumers)

    def constant(node):
        return (node.creator_node is None and node not in index
                and not node.requires_grad
                and not _derived_from(node.data, batch_ids))
    uses = {}
    for p_node, i in index.items():
        for fn, k in consumers.get(p_node, ()):
            uses.setdefault(i, []).extend(
                _followed(fn, k, params[i].shape, consumers, constant))
    return functions, uses, consumers


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

    @property
    def covered(self):
        return self.rows is not None

    def describe(self, fn):
        return ' -> '.join(self.path + [type(fn).__name__])


def _followed(fn, k, shape, consumers, constant, steps=()):
    """The uses ``[(fn, k, selection)]`` reached from input k of ``fn``
    (a parameter of ``shape``, or what ``steps``, ``[(fn, k, kind)]``,
    made of it): a rearrangement into rows of a Linear is a
    :class:`Selection`, any other path a
    :class:`~chainer_vgc.statistics.pullback.Pullback`."""
    kind = pullback.step_of(fn, k, constant)
    if kind is None:
        if not steps:
            return [(fn, k, None)]
        if all(isinstance(f, _REARRANGING) for f, _, _ in steps):
            rows = _rows_through(steps, fn, k, shape)
            if rows is not None:  # whole rows of a Linear's weight
                return [(fn, k, Selection(
                    [type(f).__name__ for f, _, _ in steps], rows))]
        return [(fn, k, pullback.Pullback(
            [pullback.Step(f, kk, kd) for f, kk, kd in steps]))]
    out = fn.outputs[0]()
    found = []
    for nxt, kk in consumers.get(out, ()):
        found.extend(_followed(nxt, kk, shape, consumers, constant,
                               steps + ((fn, k, kind),)))
    return found


def _rows_through(steps, fn, k, shape):
    """The rows of ``fn``'s weight (or bias) the parameter's rows are,
    after the rearrangements ``steps``, or None."""
    positions, key = None, ()
    for f, kk, _ in steps:
        out = f.outputs[0]()
        key = key + ((type(f).__name__, getattr(f, 'axis', None), kk,
                      tuple(tuple(n.shape) for n in f.inputs),
                      tuple(out.shape)),)
        positions = _positions(f, kk, out, shape, positions, key)
    return _row_selection(fn, k, shape, positions, key)


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
