"""docs/wire_format.md is enough to implement the format from: a decoder
written from it alone (tests/spec_decoder.py, no chainer_vgc import) agrees
with chainer_vgc.codec.unpack on every golden message (indices, value bits,
signs of zero) and accepts and refuses the same corrupted messages."""

import random

import numpy
import pytest

import golden_messages
import spec_decoder
from chainer_vgc import codec
from chainer_vgc.codec.message import walk

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

SIZES = [int(numpy.prod(s)) for s in golden_messages.SHAPES]
DTYPES = golden_messages.DTYPES


@pytest.fixture(scope='module')
def messages():
    data = numpy.load(golden_messages.PATH)
    return {k: data[k] for k in data.files}


def assert_same(reference, spec):
    assert len(reference) == len(spec)
    for group, (tid, index, values) in zip(reference, spec):
        assert group.tensor_id == tid
        assert group.index.tolist() == list(index)
        want = numpy.array(values, dtype=group.value.dtype)
        assert group.value.view(numpy.uint8).tobytes() == \
            want.view(numpy.uint8).tobytes()


def model_of(key):
    """The sizes and dtypes of a golden message (the restart-table ones,
    issue 25, have their own model)."""
    if key.startswith('restart'):
        return ([int(numpy.prod(s)) for s in golden_messages.RESTART_SHAPES],
                golden_messages.RESTART_DTYPES)
    return SIZES, DTYPES


def test_every_golden_message_decodes_alike(messages):
    formats, restarts = set(), 0
    for key, m in messages.items():
        sizes, dtypes = model_of(key)
        assert_same(codec.unpack(m, sizes, dtypes),
                    spec_decoder.decode(m, sizes, dtypes))
        formats |= {g.fmt for g in walk(m, sizes)}
        restarts += sum(spec_decoder.restart_points(g.count)
                        for g in walk(m, sizes) if g.fmt == codec.FMT_GAP)
    assert restarts > 0
    assert len(messages) >= 50
    assert formats == {codec.FMT_POW2, codec.FMT_RAW, codec.FMT_QSGD,
                       codec.FMT_GAP, codec.FMT_SPARSE}, formats


def mutate(m, rnd):
    m = m.copy()
    op = rnd.random()
    if op < 0.5:
        i = rnd.randrange(m.size)
        m[i] ^= numpy.uint32(1 << rnd.randrange(32))
    elif op < 0.7:
        m[rnd.randrange(m.size)] = numpy.uint32(rnd.choice(
            [0, 1, 2, 3, 4, 5, 0xffffffff, rnd.getrandbits(32)]))
    elif op < 0.85:
        m = m[:rnd.randrange(m.size)]
    else:
        m = numpy.insert(m, rnd.randrange(m.size), numpy.uint32(
            rnd.choice([0, 1, rnd.getrandbits(32)])))
    return m


def test_corrupted_messages_are_accepted_and_refused_alike(messages):
    rnd = random.Random(1)
    small = [m for k, m in messages.items()
             if m.size < 400 and not k.startswith('restart')]
    seen = {True: 0, False: 0}
    for _ in range(1500):
        m = mutate(rnd.choice(small), rnd)
        try:
            reference = codec.unpack(m, SIZES, DTYPES)
        except codec.WireFormatError:
            reference = None
        try:
            spec = spec_decoder.decode(m, SIZES, DTYPES)
        except spec_decoder.Invalid:
            spec = None
        assert (reference is None) == (spec is None), m.tolist()
        if reference is not None:
            assert_same(reference, spec)
        seen[reference is not None] += 1
    assert seen[True] > 100 and seen[False] > 100, seen


def test_corrupted_restart_tables_are_refused_alike(messages):
    """Messages with restart tables (issue 25), one word of a table or
    of the stream changed: both decoders accept and refuse the same ones,
    and every change to a table word is refused."""
    rnd = random.Random(25)
    seen = 0
    for key in sorted(k for k in messages if k.startswith('restart')):
        m = messages[key]
        sizes, dtypes = model_of(key)
        for g in walk(m, sizes):
            if g.fmt != codec.FMT_GAP or spec_decoder.restart_points(
                    g.count) == 0:
                continue
            start = (g.body.__array_interface__['data'][0]  # (a view)
                     - m.__array_interface__['data'][0]) // 4
            for _ in range(3):
                bad = m.copy()
                w = start + 2 + rnd.randrange(
                    4 * spec_decoder.restart_points(g.count))
                bad[w] ^= numpy.uint32(1 << rnd.randrange(32))
                with pytest.raises(codec.WireFormatError):
                    codec.unpack(bad, sizes, dtypes)
                with pytest.raises(spec_decoder.Invalid):
                    spec_decoder.decode(bad, sizes, dtypes)
                seen += 1
    assert seen >= 10
