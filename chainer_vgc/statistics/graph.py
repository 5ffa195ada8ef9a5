"""The computational graph: which function nodes consume each parameter,
and which rows of their inputs belong to which example?

Per-example contributions (paper Sec. 4.1) need the example of every row a
function sees; Chainer keeps no such record (Sec. 5: "common deep learning
libraries do not support access to gradients of each sample"), so it is
traced here from the graph before the backward pass.

Examples: the first axis of the functions' inputs.  A function whose input
has ``k * B`` rows (``n_batch_axes > 1``, or ``x.reshape(B * T, -1)`` of an
example-major ``(B, T, ...)`` array) is read as B contiguous groups of k rows;
time-major layouts would mix examples, so pass ``batch_size`` and keep the
batch axis first.  Inputs whose rows cannot be attributed to examples are
refused (:func:`_check_rows`).
"""

from chainer.functions.array import reshape as _reshape


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
    """The function nodes of loss's graph, and those that consume each of
    ``params``: ``(functions, {index: [(fn, k)]})`` (k: the input index of
    the parameter in fn)."""
    index = {id(p.node): i for i, p in enumerate(params)}
    uses = {}
    functions = _functions_of(loss)
    for fn in functions:
        for k, node in enumerate(fn.inputs):
            i = index.get(id(node))
            if i is not None:
                uses.setdefault(i, []).append((fn, k))
    return functions, uses


def _array_ids(arrays):
    return {id(a) for a in arrays}


def _derived_from(array, ids):
    """Whether ``array`` is one of the arrays ``ids`` or a view of one."""
    while array is not None:
        if id(array) in ids:
            return True
        array = getattr(array, 'base', None)
    return False


def _example_major(node, b):
    """Whether a node's k*b rows are b contiguous groups, one per example:
    a chain of reshapes (F.reshape, F.linear's n_batch_axes) of something
    whose first axis is the batch, or a C-order view of such an array."""
    while node.creator_node is not None:
        creator = node.creator_node
        if not isinstance(creator, _reshape.Reshape):
            return False
        node = creator.inputs[0]
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


def _check_rows(fn, name, b, batch_ids):
    """Refuse inputs whose rows cannot be attributed to examples (fn's
    input 0, for the parameter called name; b examples; batch_ids: the
    :func:`_array_ids` of the minibatch arrays, empty if not given)."""
    node = fn.inputs[0]
    rows = node.shape[0] if len(node.shape) else 0
    where = '{} (input of {} for parameter {})'.format(
        tuple(node.shape), type(fn).__name__, name)
    fix = ('The statistics need the examples on the first axis of every '
           'input; rows that are tokens of variable-length examples '
           '(concatenated sequences) are not supported yet. Send the '
           'parameter dense: chainer_vgc.create_communicator(..., '
           "exclude=['{}']). Where you call PerSampleSquares yourself, "
           'pass backward(..., batch=(x, ...)) or PerSampleSquares(..., '
           'batch_size=n); with create_multi_node_optimizer the batch is '
           "the arrays given to update() (Chainer's StandardUpdater "
           'passes the minibatch)'.format(name))
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
    if (batch_ids and node.creator_node is None and node.data is not None
            and not _derived_from(node.data, batch_ids)):
        raise ValueError(
            '{}: the input is a constant array, not minibatch data; '
            'per-example contributions are undefined'.format(where))
