"""Per-sample statistics of variable-length examples (issue 38): the rows a
function sees are tokens, traced through the graph to their example
(``chainer_vgc.statistics.rows``), and the recurrent layers' stacked
weights are followed to their parameters (``statistics.graph``).  The
oracle is one backward pass per example, the model built from that
example alone (noise off)."""

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainer_vgc
from chainer_vgc.harness import models
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import UncoveredParameterError
from chainer_vgc.statistics import bruteforce_sqsum
from chainer_vgc.statistics import model_params
from chainer_vgc.statistics import rows as rows_mod
from chainer_vgc.statistics import tracing

# on both stacks: the results depend on NumPy's arithmetic
pytestmark = pytest.mark.stack


def Seq2seq():
    """The shape of ChainerMN's seq2seq example (harness.models.Seq2seq):
    2-layer LSTMs with dropout 0.1, vocabularies of 7 and 9 words, 5
    units."""
    return models.Seq2seq(2, 7, 9, 5)


def sentences(rng, b, vocab, longest=6):
    return [rng.randint(0, vocab, rng.randint(1, longest + 1)).astype(
        numpy.int32) for _ in range(b)]


def per_example_oracle(model, examples, loss_of):
    """sum_z (grad of the batch loss's term of example z)**2, float64: one
    backward per example, the batch loss being the mean of ``loss_of``
    over the examples."""
    names, params = model_params(model)
    want = [None] * len(params)
    with chainer.using_config('train', False):  # (noise off)
        _passes(model, params, examples, loss_of, want)
    model.cleargrads()
    return names, want


def _passes(model, params, examples, loss_of, want):
    for example in examples:
        model.cleargrads()
        (loss_of(*example) / len(examples)).backward()
        for k, p in enumerate(params):
            if p.grad is not None:
                g = p.grad.astype(numpy.float64) ** 2
                want[k] = g if want[k] is None else want[k] + g


def assert_close(names, got, want, rtol=1e-4):
    assert len(got) == len(want)
    for name, g, w in zip(names, got, want):
        assert g is not None and w is not None, name
        numpy.testing.assert_allclose(g, w, rtol=rtol,
                                      atol=rtol * abs(w).max() + 1e-12,
                                      err_msg=name)


def as_views(arrays):
    """The arrays as views into one buffer (as ChainerMN's GPU converter's
    split, or arrays unpickled by scatter_dataset): each view's base is
    the buffer, not an array the model was given."""
    buffer = numpy.concatenate(arrays)
    at = numpy.cumsum([len(a) for a in arrays[:-1]])
    return numpy.split(buffer, at)


@pytest.mark.parametrize('form', ['pairs', 'lists', 'views'])
def test_seq2seq_sums_equal_one_backward_per_example(form):
    """Every parameter of the encoder-decoder (EmbedID over concatenated
    tokens, the LSTMs' 8 weights and 8 biases per layer through their
    stacked matrices, the projection over all time steps), with the
    minibatch as ChainerMN's flat tuple (examples=sentence_pairs), as
    lists of one array per example, or as that flat tuple of views into
    one buffer (the model's ``x[::-1]`` of a view is matched by the memory
    it spans: its base is the buffer)."""
    rng = numpy.random.RandomState(3)
    numpy.random.seed(3)
    with chainer.using_config('dtype', numpy.float64):
        model = Seq2seq()
    xs, ys = sentences(rng, 5, 7), sentences(rng, 5, 9)
    if form == 'views':
        xs, ys = as_views(xs), as_views(ys)
        assert xs[1][::-1].base is not xs[1]
    names, want = per_example_oracle(
        model, list(zip(xs, ys)), lambda x, y: model.loss([x], [y]))
    with chainer.using_config('train', False):  # dropout off: the oracle's
        if form in ('pairs', 'views'):
            hook = PerSampleSquares(model,
                                    examples=chainer_vgc.sentence_pairs)
            batch = tuple(xs) + tuple(ys)
            with hook.forward(batch) as mb:
                loss = model(*batch)
        else:
            hook = PerSampleSquares(model)
            with hook.forward((xs, ys)) as mb:
                loss = model.loss(xs, ys)
        got = hook.backward(loss, batch=mb)
    assert len(names) == 4 + 2 * 2 * 16
    assert hook.covered_names == names
    assert_close(names, got, want)


@pytest.mark.parametrize('link', ['NStepLSTM', 'NStepGRU', 'NStepRNNTanh',
                                  'NStepRNNReLU', 'NStepBiLSTM'])
def test_recurrent_layers_equal_one_backward_per_example(link):
    """A classifier over variable-length sequences of vectors: the
    recurrent layer's final state, then Linear; labels an array of the B
    examples beside the list of sequences."""
    rng = numpy.random.RandomState(5)
    numpy.random.seed(5)
    with chainer.using_config('dtype', numpy.float64):
        model = chainer.Chain()
        with model.init_scope():
            model.rnn = getattr(L, link)(2, 3, 4, 0.0)
            model.out = L.Linear(None, 3)

    def loss(xs, t):
        hy = model.rnn(None, xs)[0] if 'LSTM' not in link else \
            model.rnn(None, None, xs)[0]
        return F.softmax_cross_entropy(model.out(hy[-1]), t, reduce='no')

    xs = [rng.normal(size=(rng.randint(1, 6), 3)) for _ in range(6)]
    t = rng.randint(0, 3, 6).astype(numpy.int32)
    model.out(numpy.zeros((1, 4)))  # (initialize the lazy weight)
    names, want = per_example_oracle(
        model, [([x], t[z:z + 1]) for z, x in enumerate(xs)],
        lambda x, tz: F.sum(loss(x, tz)))
    hook = PerSampleSquares(model)
    with hook.forward((xs, t)) as mb:
        total = F.sum(loss(xs, t)) / len(xs)
    got = hook.backward(total, batch=mb)
    assert hook.covered_names == names
    assert_close(names, got, want)


def test_stacked_weights_are_followed_when_they_are_whole_rows():
    """A parameter that reaches F.linear through stack/reshape/concat is
    covered by the Linear's fast sums when it is whole rows of the weight
    (the recurrent layers' layout); interleaved columns are covered too,
    by pulling the weight's per-example contributions back through the
    reshape and the stack, and a path through a function that is not
    followed is refused with an error naming the path."""
    rng = numpy.random.RandomState(2)
    with chainer.using_config('dtype', numpy.float64):
        model = chainer.Chain()
        with model.init_scope():
            model.w0 = chainer.Parameter(rng.normal(size=(3, 4)))
            model.w1 = chainer.Parameter(rng.normal(size=(3, 4)))
            model.b0 = chainer.Parameter(rng.normal(size=(3,)))
            model.b1 = chainer.Parameter(rng.normal(size=(3,)))
    x = rng.normal(size=(5, 4))

    def rows_loss(x):
        w = F.reshape(F.stack([model.w1, model.w0], axis=1), (6, 4))
        b = F.concat([model.b1, model.b0], axis=0)
        return F.sum(F.tanh(F.linear(x, w, b))) / len(x)

    names, params = model_params(model)
    want = bruteforce_sqsum(rows_loss, params, x)
    got = PerSampleSquares(model).backward(rows_loss(x), batch=(x,))
    assert_close(names, got, want, rtol=1e-9)

    def columns_loss(x):
        w = F.reshape(F.stack([model.w0, model.w1], axis=2), (3, 8))
        return F.sum(F.tanh(F.linear(F.concat([x, x * 2], axis=1), w,
                                     model.b0))) / len(x)

    want = bruteforce_sqsum(columns_loss, params, x)
    got = PerSampleSquares(model).backward(columns_loss(x), batch=(x,))
    assert want[names.index('/b1')] is None  # (not used here)
    assert got[names.index('/b1')] is None
    keep = [i for i, n in enumerate(names) if n != '/b1']
    assert_close([names[i] for i in keep], [got[i] for i in keep],
                 [want[i] for i in keep], rtol=1e-9)

    def matmul_loss(x):
        w = F.reshape(F.stack([model.w0, model.w1], axis=2), (3, 8))
        return F.sum(F.matmul(F.concat([x, x], axis=1), w, transb=True))

    with pytest.raises(UncoveredParameterError) as info:
        PerSampleSquares(model, uncovered='error').backward(
            matmul_loss(x), batch=(x,))
    assert 'Stack -> Reshape -> MatMul' in str(info.value)
    assert sorted(info.value.names) == ['/w0', '/w1']


def test_flat_sentences_without_the_option_name_it():
    """2B arrays of different lengths (ChainerMN's converter) are not one
    batch: the error says so and names the option and where it goes,
    instead of guessing B from the first sentence's length."""
    rng = numpy.random.RandomState(0)
    model = Seq2seq()
    xs, ys = sentences(rng, 4, 7), sentences(rng, 4, 9)
    xs[0] = xs[0][:2] if len(xs[0]) > 2 else numpy.zeros(3, numpy.int32)
    batch = tuple(xs) + tuple(ys)
    with pytest.raises(ValueError) as info:
        PerSampleSquares(model).minibatch(batch)
    text = str(info.value)
    assert 'not guessed' in text
    assert 'create_communicator(..., examples=' in text
    assert 'chainer_vgc.sentence_pairs' in text
    with pytest.raises(ValueError, match='odd number'):
        chainer_vgc.sentence_pairs(*batch[:-1])
    # arrays of examples on their first axis, with a 0-d array beside them
    # (no examples in it): B is their common first axis
    x, t = numpy.zeros((4, 3)), numpy.zeros(4, numpy.int32)
    assert PerSampleSquares(model).minibatch((x, numpy.float32(2), t)).b == 4
    assert PerSampleSquares(model).minibatch(
        (x, numpy.array(2.0), t)).b == 4


def _token_model(width):
    with chainer.using_config('dtype', numpy.float64):
        model = chainer.Chain()
        with model.init_scope():
            model.embed = L.EmbedID(6, 4)
            model.lin = L.Linear(width, 2)
    return model


def test_rows_that_join_two_examples_are_refused():
    """A reshape that puts tokens of two examples in one row: the error
    names the rows' examples and the fix."""
    model = _token_model(8)
    xs = [numpy.array([1], numpy.int32), numpy.array([2, 3, 4], numpy.int32)]
    hook = PerSampleSquares(model)
    with hook.forward((xs,)) as mb:
        h = model.embed(F.concat(xs, axis=0))         # 4 tokens
        loss = F.sum(model.lin(F.reshape(h, (2, 8))))  # rows of 2 tokens
    with pytest.raises(ValueError) as info:
        hook.backward(loss, batch=mb)
    text = str(info.value)
    # (the reshape joins the tokens' rows too: the first use checked names
    # its own parameter)
    assert 'joins examples 0 and 1' in text and "exclude=['/" in text


def test_rows_no_known_function_traces_are_refused():
    """Rows that come through a function not known to keep rows apart
    (F.flip along the tokens) stay without an example: an error, not a
    guess."""
    model = _token_model(4)
    xs = [numpy.array([1], numpy.int32), numpy.array([2, 3], numpy.int32)]
    hook = PerSampleSquares(model)
    with hook.forward((xs,)) as mb:
        h = F.flip(model.embed(F.concat(xs, axis=0)), axis=0)
        loss = F.sum(model.lin(h))
    with pytest.raises(ValueError, match='cannot be traced to an example'):
        hook.backward(loss, batch=mb)


def test_components_equal_a_plain_union_find():
    rng = numpy.random.RandomState(4)
    for n, m in ((1, 0), (10, 3), (200, 150), (500, 900)):
        a = rng.randint(0, n, m)
        b = rng.randint(0, n, m)
        parent = list(range(n))

        def find(i):
            while parent[i] != i:
                i = parent[i]
            return i
        for i, j in zip(a, b):
            ri, rj = find(i), find(j)
            parent[max(ri, rj)] = min(ri, rj)
        want = [find(i) for i in range(n)]
        got = tracing.components(n, a, b) if m else numpy.arange(n)
        assert list(got) == want


def test_layout_keeps_regular_groups_and_indexes_the_rest():
    assert rows_mod.layout([0, 0, 1, 1, 2, 2], 3) == ('groups', 2)
    kind, idx = rows_mod.layout([2, 0, 2, 1, 0], 3)
    assert kind == 'index'
    # each example's rows in order, padded with 5 (the zero row)
    assert idx.tolist() == [[1, 4], [3, 5], [0, 2]]
    x = numpy.arange(10.).reshape(5, 2)
    got = rows_mod.gather_rows(numpy, x, idx)
    assert got.tolist() == [[2, 3], [8, 9], [6, 7], [0, 0], [0, 1], [4, 5]]
