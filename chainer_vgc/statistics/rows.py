"""Which example owns each row a covered function sees?

Per-example contributions (paper Sec. 4.1, Fig. "Basic") need the example
of every row a function's input has; Chainer keeps no such record (Sec. 5:
"common deep learning libraries do not support access to gradients of each
sample"), so it is read here from the minibatch and the graph.

The minibatch (what ``update()`` is given, see :func:`minibatch`) comes in
one of two forms:

* **arrays of examples**: every array has the B examples on its first axis
  (images and labels).  A function whose input has ``k * B`` rows
  (``n_batch_axes > 1``, or ``x.reshape(B * T, -1)`` of an example-major
  ``(B, T, ...)`` array) is read as B contiguous groups of k rows; inputs
  whose rows cannot be so attributed are refused (:func:`regular_layout`).
* **one array per example** (variable-length sequences): a list or tuple of
  B arrays, one per example (each array's rows are that example's tokens),
  or any layout an ``examples`` function maps to B examples (ChainerMN's
  seq2seq passes its source and target sentences as 2B positional
  arrays: :func:`sentence_pairs`).  Models concatenate such sequences
  (``F.concat`` before ``EmbedID``, the output projection over all time
  steps), split them again, transpose them into time steps
  (``NStepLSTM``), so the rows are traced through the graph
  (:mod:`~chainer_vgc.statistics.tracing`), starting from the arrays the
  forward pass was given (:class:`Recorder`).  Each use's rows are then
  regrouped by example (:func:`layout`, :func:`gather_rows`).

The batch size is never guessed from an element's length: when the
minibatch's arrays disagree on their first axis and nothing says which
arrays belong to which example, the error names the option.
"""

import numpy

from chainer.functions.activation import clipped_relu as _clipped_relu
from chainer.functions.activation import elu as _elu
from chainer.functions.activation import leaky_relu as _leaky_relu
from chainer.functions.activation import log_softmax as _log_softmax
from chainer.functions.activation import prelu as _prelu
from chainer.functions.activation import relu as _relu
from chainer.functions.activation import sigmoid as _sigmoid
from chainer.functions.activation import softmax as _softmax
from chainer.functions.activation import softplus as _softplus
from chainer.functions.activation import swish as _swish
from chainer.functions.activation import tanh as _tanh
from chainer.functions.array import get_item as _get_item
from chainer.functions.array import reshape as _reshape
from chainer.functions.array import transpose as _transpose
from chainer.functions.array import where as _where
from chainer.functions.connection import convolution_2d as _conv
from chainer.functions.connection import deconvolution_2d as _deconv
from chainer.functions.connection import embed_id as _embed
from chainer.functions.connection import linear as _linear
from chainer.functions.loss import softmax_cross_entropy as _softmax_ce
from chainer.functions.math import matmul as _matmul
from chainer.functions.noise import dropout as _dropout
from chainer.functions.normalization import layer_normalization as \
    _layer_norm
import chainer


#: where the option that says which arrays belong to which example goes
EXAMPLES_OPTION = (
    'chainer_vgc.create_communicator(..., examples=f), f(*args, **kwargs) '
    "returning the minibatch's examples, one array or tuple of arrays "
    'each, from the arguments update() gets (for a converter that returns '
    'the B source sentences and then the B target sentences, as '
    "ChainerMN's seq2seq example does: examples=chainer_vgc.sentence_pairs"
    '; PerSampleSquares(..., examples=f) where you call the hook yourself)')


def sentence_pairs(*arrays):
    """The examples of a minibatch passed as ``x_1, ..., x_B, y_1, ...,
    y_B`` (ChainerMN's seq2seq converter): ``[(x_1, y_1), ...]``."""
    if len(arrays) % 2:
        raise ValueError(
            'sentence_pairs: {} arrays, an odd number; it reads the '
            'minibatch as B source sentences followed by B target '
            'sentences'.format(len(arrays)))
    half = len(arrays) // 2
    return list(zip(arrays[:half], arrays[half:]))


def _is_array(a):
    return hasattr(a, 'shape') and hasattr(a, 'dtype')


def _is_sequence_list(a):
    return (isinstance(a, (list, tuple)) and len(a) > 0
            and all(_is_array(x) for x in a))


class Minibatch(object):
    """The minibatch of one update and its examples.

    ``arrays``: the arrays with the examples on their first axis (a tuple;
    what brute force slices); ``b``: the number of examples;
    ``per_example``: {id(array): example} of the arrays that hold one
    example each (empty for a minibatch of arrays of examples);
    ``keep``: those arrays, so that their ids stay theirs; ``leaves``:
    the :class:`Recorder`'s record of the forward pass (None: not
    recorded; the graph's own data is then read where it kept it).
    """

    def __init__(self, arrays, b, per_example=None, keep=()):
        self.arrays = tuple(arrays)
        self.b = b
        self.per_example = dict(per_example or {})
        self.keep = list(keep)
        self.leaves = None
        self._spans = None
        self._batch_ids = {id(a) for a in self.arrays}

    @property
    def traced(self):
        """Whether rows are traced through the graph (one array per
        example) instead of read as groups of the first axis."""
        return bool(self.per_example)

    def label_of(self, array):
        """For an array a function was given: ``('example', z)`` if it is
        one example's array or a view into its memory (``x[::-1]``; NumPy
        and CuPy record only the array that owns the memory as a view's
        base, so views are matched by the memory they span), ``('rows',
        None)`` if it is one of the arrays of examples itself, else
        None."""
        z = self.per_example.get(id(array))
        if z is not None:
            return 'example', z
        if id(array) in self._batch_ids and len(getattr(
                array, 'shape', ())) and array.shape[0] == self.b:
            return 'rows', None
        if self._spans is None:
            self._spans = _Spans(self.keep, self.per_example)
        z = self._spans.find(array)
        return None if z is None else ('example', z)


def _root(a):
    """The object that owns the memory of array ``a`` (its last base)."""
    while getattr(a, 'base', None) is not None:
        a = a.base
    return a


def _bounds(a):
    """[lo, hi) of the bytes array ``a`` spans, or None."""
    try:
        ptr = (a.data.ptr if hasattr(a.data, 'ptr')
               else a.__array_interface__['data'][0])
    except (AttributeError, KeyError, TypeError):
        return None
    lo = hi = ptr
    for n, st in zip(a.shape, a.strides):
        if n == 0:
            return ptr, ptr
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + a.itemsize


class _Spans(object):
    """The memory of the per-example arrays, by the object that owns it:
    finds the example whose array's bytes contain a view's, when exactly
    one does."""

    def __init__(self, arrays, per_example):
        self._by_root = {}
        for a in arrays:
            z = per_example.get(id(a))
            span = _bounds(a) if z is not None else None
            if span is not None and span[1] > span[0]:
                self._by_root.setdefault(id(_root(a)), []).append(
                    span + (z,))

    def find(self, array):
        candidates = self._by_root.get(id(_root(array)))
        if not candidates:
            return None
        span = _bounds(array)
        if span is None:
            return None
        found = {z for lo, hi, z in candidates
                 if lo <= span[0] and span[1] <= hi}
        return found.pop() if len(found) == 1 else None


def minibatch(batch=(), examples=None, kwargs=None, batch_size=None):
    """The :class:`Minibatch` of ``batch`` (``update()``'s positional
    arguments; ``kwargs`` its keyword ones), read by ``examples`` (a
    function of them returning the examples) when given, else by the rule
    of the module doc.  ``batch_size``: the number of examples when the
    batch is not given (arrays of examples only)."""
    kwargs = kwargs or {}
    if examples is not None:
        groups = examples(*batch, **kwargs)
        groups = list(groups)
        if not groups:
            raise ValueError('the examples function returned no examples '
                             '({})'.format(EXAMPLES_OPTION))
        per_example, keep = {}, []
        for z, group in enumerate(groups):
            items = group if isinstance(group, (list, tuple)) else (group,)
            for a in items:
                if not _is_array(a):
                    raise ValueError(
                        'example {} of the examples function holds a {}, '
                        'not an array'.format(z, type(a).__name__))
                per_example[id(a)] = z
                keep.append(a)
        return Minibatch((), len(groups), per_example, keep)
    items = list(batch) + list(kwargs.values())
    lists = [a for a in items if _is_sequence_list(a)]
    # (brute force's order: the positional arrays, else the keyword ones;
    # 0-d arrays hold no examples)
    arrays = ([a for a in batch if _is_array(a) and len(a.shape)]
              or [a for a in kwargs.values() if _is_array(a)
                  and len(a.shape)])
    if lists:
        lengths = sorted({len(a) for a in lists})
        b = lengths[0]
        bad = [a.shape[0] for a in arrays if a.shape[0] != b]
        if len(lengths) > 1 or bad:
            raise ValueError(
                'the minibatch has lists of {} arrays (one per example) and '
                'arrays of first axis {}: the number of examples is not '
                'clear. Say which arrays belong to which example: {}'
                .format(lengths, sorted(set(bad)), EXAMPLES_OPTION))
        per_example, keep = {}, []
        for seq in lists:
            for z, a in enumerate(seq):
                per_example[id(a)] = z
                keep.append(a)
        return Minibatch(arrays, b, per_example, keep)
    if batch_size is not None:
        return Minibatch(arrays, int(batch_size))
    if not arrays:
        raise ValueError(
            'PerSampleSquares needs the number of examples: pass batch=(x, '
            '...) to backward() or batch_size= to the constructor (guessing '
            'it from the graph can merge examples silently)')
    firsts = [a.shape[0] for a in arrays]
    if len(set(firsts)) > 1:
        raise ValueError(
            "the minibatch's arrays have {} rows on their first axis: they "
            'are not one batch of examples, and the number of examples is '
            'not guessed from them. If each array is one example (a '
            'sequence of tokens), pass them as lists, one array per example '
            '(a converter returning {{"xs": [...], "ys": [...]}}), or say '
            'which arrays belong to which example: {}'.format(
                _some(firsts), EXAMPLES_OPTION))
    return Minibatch(arrays, firsts[0])


def _some(values, n=6):
    values = list(values)
    text = ', '.join(str(v) for v in values[:n])
    return text + (', ... ({} arrays)'.format(len(values))
                   if len(values) > n else '')


class Recorder(chainer.FunctionHook):
    """Records, during the forward pass, which inputs of which function
    nodes are the minibatch's per-example arrays (Chainer does not keep
    the data of inputs a function does not need for its backward, so the
    graph alone cannot tell).  ``leaves``: {(id(fn), k): label} with
    :meth:`Minibatch.label_of`'s labels; ``nodes`` keeps the function
    nodes, so that their ids stay theirs."""

    name = 'PerSampleSquares.Recorder'

    def __init__(self, batch):
        self.batch = batch
        self.leaves = {}
        self.nodes = []

    def forward_preprocess(self, function, in_data):
        """Chainer's callback before ``function``'s forward: note its
        inputs that are per-example arrays of the minibatch."""
        for k, a in enumerate(in_data):
            label = self.batch.label_of(a)
            if label is not None:
                self.leaves[(id(function), k)] = label
                self.nodes.append(function)


# ---- arrays of examples: groups of the first axis ---------------------------

def _derived_from(array, ids):
    """Whether ``array`` is one of the arrays ``ids`` or a view of one."""
    while array is not None:
        if id(array) in ids:
            return True
        array = getattr(array, 'base', None)
    return False


#: functions whose output row i is made from row i of their input 0 (and
#: of nothing else's rows): layers applied to each row, and functions of
#: each row alone
_ROW_WISE_INPUT0 = (
    _linear.LinearFunction, _layer_norm.LayerNormalization,
    _embed.EmbedIDFunction, _conv.Convolution2DFunction,
    _deconv.Deconvolution2DFunction, _dropout.Dropout,
    _relu.ReLU, _tanh.Tanh, _sigmoid.Sigmoid, _leaky_relu.LeakyReLU,
    _elu.ELU, _softplus.Softplus, _clipped_relu.ClippedReLU,
    _prelu.PReLUFunction, _swish.Swish)


def _keeps_rows(fn):
    """Whether function node fn keeps the first axis of its inputs: its
    output's row i is computed from row i of the inputs :func:`_row_sources`
    names."""
    if isinstance(fn, _ROW_WISE_INPUT0) or getattr(fn, 'is_elementwise',
                                                   False):
        return True
    if isinstance(fn, (_softmax.Softmax, _log_softmax.LogSoftmax)):
        return fn.axis != 0
    if isinstance(fn, _transpose.Transpose):
        return fn.axes is not None and fn.axes[0] == 0
    if isinstance(fn, _where.Where):
        return True
    if isinstance(fn, _matmul.MatMul):  # batched over the first axis
        return all(len(i.shape) >= 3 for i in fn.inputs)
    if isinstance(fn, _get_item.GetItem):
        keys = fn.slices if isinstance(fn.slices, tuple) else (fn.slices,)
        first = keys[0] if keys else slice(None)
        return (isinstance(first, slice) and first == slice(None)) or \
            first is Ellipsis
    return False


def _row_sources(creator, node):
    """The inputs of function node ``creator`` whose row i makes row i of
    its output ``node``: input 0 of the layers and row functions
    (``_ROW_WISE_INPUT0``: Linear, LayerNorm, EmbedID, convolutions,
    activations, dropout); for an elementwise function (Chainer's
    ``is_elementwise``: arithmetic, broadcasting included), ``F.where``, a
    batched ``F.matmul`` and a softmax not over the rows, the inputs of
    the output's rank and rows; for a transpose that keeps the first axis
    first and a ``GetItem`` that keeps it whole, the input.  Other
    functions: none (their rows are not followed)."""
    if not _keeps_rows(creator):
        return []
    if isinstance(creator, _ROW_WISE_INPUT0):
        return [creator.inputs[0]]
    return [i for i in creator.inputs
            if len(i.shape) == len(node.shape) and len(i.shape)
            and i.shape[0] == node.shape[0]]


def _example_major(node, b):
    """Whether a node's k*b rows are b contiguous groups, one per example:
    a chain of reshapes (F.reshape, F.linear's n_batch_axes) of something
    whose first axis is the batch, through functions that keep every row
    where it is (:func:`_row_sources`: a Linear, a LayerNorm or an
    activation between the reshape and this use), or a C-order view of
    such an array."""
    while node.creator_node is not None:
        creator = node.creator_node
        if isinstance(creator, _reshape.Reshape):
            node = creator.inputs[0]
        else:
            sources = _row_sources(creator, node)
            if not sources:
                return False
            node = sources[0]
        if len(node.shape) and node.shape[0] == b:
            return True
    data = node.data
    while data is not None:
        base = getattr(data, 'base', None)
        if base is None:
            return False
        if (getattr(base, 'ndim', 0) and base.shape[0] == b
                and getattr(data.flags, 'c_contiguous', False)
                and base.flags.c_contiguous):
            return True
        data = base
    return False


def describe_input(fn, name, index=0):
    """How an error names input ``index`` of ``fn``, for the parameter
    ``name``."""
    node = fn.inputs[index]
    return '{} (input of {} for parameter {})'.format(
        tuple(node.shape), type(fn).__name__, name)


def regular_layout(fn, name, batch, consumers=None, row_input=0):
    """The rows of ``fn``'s input ``row_input`` (0, or the data operand
    of an elementwise function; for the parameter called ``name``) as
    B contiguous groups: the group size k; or ValueError for rows that
    cannot be attributed to examples that way (``batch``: the
    :class:`Minibatch` of arrays of examples).

    An input that is a constant array (an RNN's initial state, a mask)
    has rows that belong to no example by themselves; they are read as
    the examples' when the rows of ``fn``'s output are (its output
    gradient's rows are the examples' then): the output, followed forward,
    meets minibatch rows row for row (:func:`_rows_owned_downstream`;
    ``consumers``: ``{variable node: [(function node, input index)]}``,
    :func:`~chainer_vgc.statistics.graph._scan`'s)."""
    node = fn.inputs[row_input]
    b = batch.b
    rows = node.shape[0] if len(node.shape) else 0
    where = describe_input(fn, name, row_input)
    fix = ('The statistics read the examples on the first axis of every '
           'input. If the rows are tokens of variable-length examples '
           '(concatenated sequences), give the minibatch as one array per '
           'example (lists) or say which arrays belong to which example: '
           '{}. Or send the parameter dense: chainer_vgc.create_communicator'
           "(..., exclude=['{}']). Where you call PerSampleSquares "
           'yourself, pass backward(..., batch=(x, ...)) or '
           'PerSampleSquares(..., batch_size=n); with '
           'create_multi_node_optimizer the batch is the arrays given to '
           "update() (Chainer's StandardUpdater passes the minibatch)"
           .format(EXAMPLES_OPTION, name))
    if rows == 0 or rows % b:
        raise ValueError(
            '{}: {} rows on the example axis, not a multiple of the '
            'batch size {}. {}'.format(where, rows, b, fix))
    if rows != b and not _example_major(node, b):
        raise ValueError(
            '{}: {} rows for {} examples, and they do not come from an '
            'example-major reshape of the batch (e.g. a concatenation or '
            'a time-major layout): per-example contributions are '
            'undefined. {}'.format(where, rows, b, fix))
    if (batch.arrays and node.creator_node is None and node.data is not None
            and not _derived_from(node.data, batch._batch_ids)
            and not _rows_owned_downstream(fn, consumers, batch)):
        raise ValueError(
            '{}: the input is a constant array, not minibatch data, and '
            'the output is not combined row by row with minibatch data '
            'either; per-example contributions are undefined'.format(where))
    return rows // b


def _rows_owned_downstream(fn, consumers, batch, limit=20000):
    """Whether ``fn``'s output rows are the examples': following its output
    forward through functions that keep rows where they are
    (:func:`_keeps_rows`, reshapes), it meets, row for row, an operand
    whose rows come from the minibatch's (:func:`_rows_from_minibatch`):
    the other operand of an elementwise function, of ``F.where`` or of a
    batched ``F.matmul`` (attention over an encoder's memory), or the
    labels of a loss (``softmax_cross_entropy(logits, t)``).  Then its row
    i belongs to the example whose row i that operand is, which the
    regular layout reads as an example's (an RNN's constant initial state,
    a decoder's input computed from the batch's targets with NumPy)."""
    if not consumers:
        return False
    start = fn.outputs[0]()
    if start is None:
        return False
    seen, stack = set(), [start]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node in seen or not len(node.shape):
            continue
        seen.add(node)
        for nxt, _ in consumers.get(node, ()):
            others = [o for o in nxt.inputs if o is not node]
            if isinstance(nxt, _softmax_ce.SoftmaxCrossEntropy):
                if nxt.inputs[0] is node and _rows_from_minibatch(
                        nxt.inputs[1], batch):
                    return True
                continue
            if not (isinstance(nxt, _reshape.Reshape) or
                    _keeps_rows(nxt)):
                continue
            if not isinstance(nxt, (_reshape.Reshape, _ROW_WISE_INPUT0)):
                for other in others:
                    if (len(other.shape) == len(node.shape) and
                            other.shape[0] == node.shape[0] and
                            _rows_from_minibatch(other, batch)):
                        return True
            out = nxt.outputs[0]() if len(nxt.outputs) == 1 else None
            if out is not None:
                stack.append(out)
    return False


def _rows_from_minibatch(node, batch, limit=10000):
    """Whether ``node``'s rows come from a minibatch array's rows: going
    back through reshapes and the functions that keep rows where they are
    (:func:`_row_sources`; a reduction or a broadcast over the rows ends
    that path), some path reaches one of the minibatch's arrays (or a view
    of one)."""
    seen, stack = set(), [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        creator = n.creator_node
        if creator is None:
            if n.data is not None and _derived_from(n.data,
                                                    batch._batch_ids):
                return True
            continue
        if isinstance(creator, _reshape.Reshape):
            stack.append(creator.inputs[0])
        else:
            stack.extend(_row_sources(creator, n))
    return False


def layout(owners, b):
    """How a use's rows become B groups: ``('groups', k)`` when they
    already are B contiguous groups of k rows in example order, else
    ``('index', idx)``: idx (b, k) the rows of each example, padded with
    ``len(owners)`` (a zero row appended)."""
    owners = numpy.asarray(owners, numpy.int64)
    rows = len(owners)
    counts = numpy.bincount(owners, minlength=b)
    k = int(counts.max()) if rows else 0
    if k and rows == b * k and numpy.array_equal(
            owners, numpy.repeat(numpy.arange(b), k)):
        return 'groups', k
    order = numpy.argsort(owners, kind='stable')
    starts = numpy.cumsum(counts) - counts
    sorted_owners = owners[order]
    rank = numpy.arange(rows) - starts[sorted_owners]
    idx = numpy.full((b, max(k, 1)), rows, numpy.int64)
    idx[sorted_owners, rank] = order
    return 'index', idx


def gather_rows(xp, a, idx):
    """``a``'s rows in the (b, k) order of ``idx`` (``len(a)``: a zero
    row), as a (b * k, ...) array."""
    pad = xp.zeros((1,) + tuple(a.shape[1:]), a.dtype)
    full = xp.concatenate([a, pad], axis=0)
    return xp.take(full, xp.asarray(idx.reshape(-1)), axis=0)
