"""Rows traced through the graph: which example owns each row of each
array, for a minibatch of one array per example (variable-length
sequences; :mod:`~chainer_vgc.statistics.rows` says when)?

Every row of every array in the graph is an item.  The functions that keep
rows apart (row-wise arithmetic and activations on equal shapes, Linear,
convolutions, EmbedID, batch normalization, LSTM cells, dropout, softmax
cross entropy) join an output row to the same row of their inputs; the
functions that move rows (``concat``/``split_axis`` along axis 0,
``transpose_sequence``, ``reshape``: rows that share elements,
``permutate`` along axis 0) join the rows they move; and the minibatch's
arrays label their rows with their example.  A row gets the example of the
labelled rows it is joined to (an EOS constant or an LSTM's zero initial
state gets it from the rows it is combined with).  A function not known
here joins nothing: its rows may then stay unlabelled, which is an error,
never a wrong label.  Rows that join two examples (a function that mixes
them), and rows that join none, are refused with an error that says where
the fix goes.  The components are found by hooking and pointer jumping in
whole-array NumPy operations (:func:`components`).
"""

import math

import numpy

import chainer
from chainer.functions.array import concat as _concat
from chainer.functions.array import get_item as _get_item
from chainer.functions.array import permutate as _permutate
from chainer.functions.array import reshape as _reshape
from chainer.functions.array import split_axis as _split_axis
from chainer.functions.array import transpose_sequence as _transpose_seq
from chainer.functions.connection import convolution_2d as _conv
from chainer.functions.connection import deconvolution_2d as _deconv
from chainer.functions.connection import embed_id as _embed
from chainer.functions.connection import linear as _linear
from chainer.functions.loss import softmax_cross_entropy as _softmax_ce
from chainer.functions.normalization import batch_normalization as _bn
from chainer.functions.rnn import lstm as _lstm

from chainer_vgc.statistics.rows import EXAMPLES_OPTION
from chainer_vgc.statistics.rows import describe_input


#: functions that keep rows apart, and the inputs whose rows are the
#: output's rows (by class; subclasses too)
_ROW_INPUTS = (
    (_linear.LinearFunction, (0,)),
    (_conv.Convolution2DFunction, (0,)),
    (_deconv.Deconvolution2DFunction, (0,)),
    (_embed.EmbedIDFunction, (0,)),
    (_bn.BatchNormalization, (0,)),
    (_bn.FixedBatchNormalization, (0,)),
    (_lstm.LSTM, (0, 1)),
    (_softmax_ce.SoftmaxCrossEntropy, (0, 1)),
)

#: modules whose functions are elementwise: an input of the output's exact
#: shape has the output's rows (broadcast inputs join nothing)
_ELEMENTWISE_MODULES = (
    'chainer.functions.activation.',
    'chainer.functions.math.basic_math',
    'chainer.functions.math.exponential',
    'chainer.functions.math.sqrt',
    'chainer.functions.math.square',
    'chainer.functions.math.clip',
    'chainer.functions.noise.dropout',
    'chainer.functions.array.cast',
    'chainer.functions.array.copy',
    'chainer.functions.array.where',
)


def _row_inputs(fn):
    for cls, inputs in _ROW_INPUTS:
        if isinstance(fn, cls):
            return inputs
    return None


def _elementwise(fn):
    module = type(fn).__module__ or ''
    return any(module.startswith(m) for m in _ELEMENTWISE_MODULES)


def _rows_of(node):
    shape = getattr(node, 'shape', None)
    return int(shape[0]) if shape is not None and len(shape) else None


class Tracer(object):
    """The examples of the rows of a graph's arrays, for a minibatch of one
    array per example (module doc).

    ``functions``: the graph's function nodes; ``params``: the ids of the
    parameters' variable nodes (arrays computed from parameters alone have
    no examples); ``batch``: the :class:`Minibatch`; ``leaves``: the
    :class:`Recorder`'s record (or None: the graph's own data is read).
    """

    def __init__(self, functions, params, batch, leaves=None):
        self.batch = batch
        self._start = {}   # id(node) -> first item
        self._nodes = []   # the nodes, so that their ids stay theirs
        self._n = 0
        self._pairs = []   # (items, items) joined
        self._labelled = []  # (items, examples)
        data = self._data_nodes(functions, params)
        for fn in functions:
            self._join(fn, data)
            self._label(fn, leaves)
        self._solve()

    # -- items ---------------------------------------------------------------
    def _items(self, node):
        rows = _rows_of(node)
        if rows is None:
            return None
        start = self._start.get(id(node))
        if start is None:
            start = self._start[id(node)] = self._n
            self._nodes.append(node)
            self._n += rows
        return numpy.arange(start, start + rows)

    def _pair(self, a, b):
        if a is not None and b is not None and len(a) == len(b) and len(a):
            self._pairs.append((a, b))

    @staticmethod
    def _data_nodes(functions, params):
        """ids of the nodes that depend on something other than
        parameters (minibatch data or constants)."""
        data = set()
        for fn in sorted(functions, key=lambda f: f.rank):
            if any(id(n) not in params and (n.creator_node is None
                                            or id(n) in data)
                   for n in fn.inputs):
                for ref in fn.outputs:
                    node = ref()
                    if node is not None:
                        data.add(id(node))
        return data

    def _label(self, fn, leaves):
        for k, node in enumerate(fn.inputs):
            if node.creator_node is not None:
                continue
            if leaves is not None:
                label = leaves.get((id(fn), k))
            else:
                label = (self.batch.label_of(node.data)
                         if node.data is not None else None)
            if label is None:
                continue
            items = self._items(node)
            if items is None:
                continue
            kind, z = label
            if kind == 'example':
                self._labelled.append((items, numpy.full(len(items), z)))
            elif len(items) == self.batch.b:
                self._labelled.append((items, numpy.arange(len(items))))

    def _join(self, fn, data):
        ins = [n if (n.creator_node is None or id(n) in data) else None
               for n in fn.inputs]
        outs = [r() for r in fn.outputs]
        outs = [o if o is not None and id(o) in data else None for o in outs]
        if not any(o is not None for o in outs):
            return
        if isinstance(fn, _concat.Concat):
            self._concat(fn, ins, outs[0])
        elif isinstance(fn, _split_axis.SplitAxis):
            self._split(fn, ins[0], outs)
        elif isinstance(fn, _transpose_seq.TransposeSequence):
            self._transpose_sequence(ins, outs)
        elif isinstance(fn, _reshape.Reshape):
            self._reshape(ins[0], outs[0])
        elif isinstance(fn, _permutate.Permutate):
            self._permute(fn, ins[0], outs[0])
        elif isinstance(fn, _get_item.GetItem):
            slices = fn.slices if isinstance(fn.slices, tuple) else (
                fn.slices,)
            if slices and isinstance(slices[0], slice) and \
                    slices[0] == slice(None):
                self._rowwise([ins[0]], outs)
        else:
            inputs = _row_inputs(fn)
            if inputs is not None:
                self._rowwise([ins[k] for k in inputs if k < len(ins)], outs)
            elif _elementwise(fn) and outs[0] is not None:
                shape = tuple(outs[0].shape)
                self._rowwise([n for n in ins if n is not None
                               and tuple(n.shape) == shape],
                              [o for o in outs if o is not None
                               and tuple(o.shape) == shape])

    def _rowwise(self, ins, outs):
        """Join row r of every node in ins and outs that has the rows of
        the first output (or, for a reduced output, of the first
        input)."""
        nodes = [n for n in list(outs) + list(ins) if n is not None
                 and _rows_of(n) is not None]
        if len(nodes) < 2:
            return
        rows = _rows_of(nodes[0])
        nodes = [n for n in nodes if _rows_of(n) == rows]
        first = self._items(nodes[0])
        for n in nodes[1:]:
            self._pair(first, self._items(n))

    def _concat(self, fn, ins, out):
        if out is None:
            return
        axis = fn.axis % len(out.shape) if len(out.shape) else 0
        if axis != 0:
            self._rowwise(ins, [out])
            return
        items, at = self._items(out), 0
        for node, x in zip(fn.inputs, ins):
            rows = _rows_of(node) or 0
            if x is not None:
                self._pair(self._items(x), items[at:at + rows])
            at += rows

    def _split(self, fn, x, outs):
        if x is None:
            return
        ndim = len(x.shape)
        axis = fn.axis % ndim if ndim else 0
        if axis != 0:
            self._rowwise([x], outs)
            return
        rows = _rows_of(x)
        if fn.indices is not None:
            bounds = [0] + [int(i) for i in fn.indices] + [rows]
        else:
            step = rows // int(fn.sections)
            bounds = list(range(0, rows + 1, step))
        items = self._items(x)
        for o, lo, hi in zip(outs, bounds[:-1], bounds[1:]):
            if o is not None:
                self._pair(items[lo:hi], self._items(o))

    def _transpose_sequence(self, ins, outs):
        # output t, row i <-> input i, row t (the inputs by decreasing
        # length, as transpose_sequence requires)
        starts = numpy.array([self._items(x)[0] if x is not None
                              and _rows_of(x) else -1 for x in ins])
        for t, o in enumerate(outs):
            if o is None:
                continue
            items = self._items(o)
            src = starts[:len(items)]
            ok = src >= 0
            self._pair(items[ok], src[ok] + t)

    def _reshape(self, x, out):
        if x is None or out is None:
            return
        rx, ro = _rows_of(x), _rows_of(out)
        if rx is None or ro is None or rx == 0 or ro == 0:
            return
        size = math.prod(x.shape)
        sx, so = size // rx, size // ro
        if not sx or not so:
            return
        # rows of x and of out that share an element (C order)
        first = numpy.arange(rx) * sx // so
        last = ((numpy.arange(rx) + 1) * sx - 1) // so
        counts = last - first + 1
        xs = numpy.repeat(numpy.arange(rx), counts)
        os_ = numpy.repeat(first, counts) + (
            numpy.arange(counts.sum()) - numpy.repeat(
                numpy.cumsum(counts) - counts, counts))
        self._pair(self._items(x)[xs], self._items(out)[os_])

    def _permute(self, fn, x, out):
        if x is None or out is None or fn.axis % max(1, len(x.shape)) != 0:
            return
        indices = numpy.asarray(chainer.backend.CpuDevice().send(
            fn.indices) if not isinstance(fn.indices, numpy.ndarray)
            else fn.indices)
        if fn.inv:
            indices = numpy.argsort(indices)
        # out[i] = x[indices[i]]
        self._pair(self._items(out), self._items(x)[indices])

    # -- the solution --------------------------------------------------------
    def _solve(self):
        n = self._n
        parent = numpy.arange(n)
        if self._pairs:
            a = numpy.concatenate([p for p, _ in self._pairs])
            b = numpy.concatenate([q for _, q in self._pairs])
            parent = components(n, a, b)
        self._root = parent
        low = numpy.full(n, numpy.iinfo(numpy.int64).max, numpy.int64)
        high = numpy.full(n, -1, numpy.int64)
        for items, z in self._labelled:
            r = parent[items]
            numpy.minimum.at(low, r, z)
            numpy.maximum.at(high, r, z)
        self._low, self._high = low, high

    def owners(self, fn, name, row_input=0):
        """The example of each row of ``fn``'s input ``row_input`` (an
        int64 array), or ValueError naming the parameter ``name`` and the
        fix."""
        node = fn.inputs[row_input]
        start = self._start.get(id(node))
        rows = _rows_of(node)
        where = describe_input(fn, name, row_input)
        if start is None or rows is None:
            raise ValueError(
                '{}: its rows are not traced to the examples of the '
                'minibatch (the input does not depend on it). {}'.format(
                    where, _fix(name)))
        roots = self._root[start:start + rows]
        low, high = self._low[roots], self._high[roots]
        missing = high < 0
        if missing.any():
            raise ValueError(
                '{}: {} of its {} rows cannot be traced to an example of '
                'the minibatch through the functions that made them (a '
                'function not known to keep rows apart, or the rows are '
                'constants). {}'.format(where, int(missing.sum()), rows,
                                        _fix(name)))
        mixed = low != high
        if mixed.any():
            r = int(numpy.argmax(mixed))
            raise ValueError(
                '{}: row {} joins examples {} and {} (a function mixes '
                'rows of several examples): per-example contributions are '
                'undefined. {}'.format(where, r, int(low[r]), int(high[r]),
                                       _fix(name)))
        return high


def _fix(name):
    return ("Send the parameter dense: chainer_vgc.create_communicator(..., "
            "exclude=['{}']), or say which arrays belong to which example: "
            '{}'.format(name, EXAMPLES_OPTION))


def components(n, a, b):
    """The root (smallest item) of each of n items' connected component,
    the pairs (a[i], b[i]) joined: hooking and pointer jumping, in whole
    array operations (a few rounds for the graphs of a training step)."""
    parent = numpy.arange(n)
    while True:
        ra, rb = parent[a], parent[b]
        lo, hi = numpy.minimum(ra, rb), numpy.maximum(ra, rb)
        moved = lo != hi
        if not moved.any():
            return parent
        numpy.minimum.at(parent, hi[moved], lo[moved])
        while True:
            up = parent[parent]
            if numpy.array_equal(up, parent):
                break
            parent = up
