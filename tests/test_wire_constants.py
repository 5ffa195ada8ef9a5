"""The wire-format constants that chainer_vgc.codec and the C++/CUDA sources
both define agree: the ``#define VGC_...`` lines of kernels/vgc_numerics.cuh
(the CuPy kernels' source) and of the native backend's sources
(kernels/vgc_host.cpp and its headers, chainer_vgc.engines.native.bindings.SOURCES) are parsed
and compared with codec by :func:`chainer_vgc.codec.check_kernel_constants`;
the native backend compares its compiled constants at load
(tests/test_native.py)."""

import os
import re

import pytest

from chainer_vgc import codec
from chainer_vgc.codec.c_defines import c_int
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.engines.native import bindings

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack


def _replace_define(text, name, value):
    """``text`` with ``#define name ...`` given ``value`` (once)."""
    altered, n = re.subn(r'(#define {}[ \t]+).*'.format(name),
                         lambda m: m.group(1) + value, text)
    assert n == 1, name
    return altered


def test_kernel_source_matches_codec():
    found = codec.check_kernel_constants(kernels.source())
    assert found == {'VGC_INDEX_BITS': codec.INDEX_BITS,
                     'VGC_INDEX_MASK': codec.MAX_INDEX - 1,
                     'VGC_MAX_D': codec.MAX_D,
                     'VGC_LOG2_ZERO': codec.LOG2_ZERO,
                     'VGC_GAP_ESCAPE': codec.GAP_ESCAPE,
                     'VGC_MAGIC': codec.MAGIC,
                     'VGC_FMT_POW2': codec.FMT_POW2,
                     'VGC_FMT_RAW': codec.FMT_RAW,
                     'VGC_HEADER_WORDS': codec.HEADER_WORDS,
                     'VGC_RAW_DENSE': codec.RAW_DENSE,
                     'VGC_RAW_FLOAT64': codec.RAW_FLOAT64,
                     'VGC_FMT_GAP': codec.FMT_GAP,
                     'VGC_GAP_SIGN_ONLY': codec.GAP_SIGN_ONLY,
                     'VGC_GAP_PARAM_WORDS': codec.GAP_PARAM_WORDS,
                     'VGC_GAP_RESTART_CODES': codec.GAP_RESTART_CODES,
                     'VGC_GAP_RESTART_WORDS': codec.GAP_RESTART_WORDS,
                     'VGC_GAP_RESTARTS': codec.GAP_RESTARTS,
                     'VGC_MERGE_MAX_COUNT': codec.MERGE_MAX_COUNT}


def test_host_source_matches_codec():
    # the native backend's sources (native.SOURCES: kernels/vgc_host.cpp and
    # the headers it includes), wherever among them the constants live
    paths = [os.path.join(kernels.source_dir(), name)
             for name in bindings.SOURCES]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        pytest.skip('the native sources are not shipped here: {}'.format(
            ', '.join(missing)))
    text = ''
    for path in paths:
        with open(path) as f:
            text += f.read() + '\n'
    names = [n for n in codec.C_CONSTANTS if n not in codec.KERNEL_CONSTANTS]
    found = codec.check_kernel_constants(text, names)
    assert sorted(found) == sorted(names)


def test_every_native_constant_has_a_codec_value():
    assert set(bindings.CONSTANTS) <= set(codec.C_CONSTANTS)


@pytest.mark.parametrize('name,value', [
    ('VGC_INDEX_BITS', '27'),
    ('VGC_INDEX_MASK', '0x07FFFFFFu'),
    ('VGC_MAX_D', '6'),
    ('VGC_LOG2_ZERO', '(-(1 << 29))'),
])
def test_an_altered_kernel_constant_fails(name, value):
    altered = _replace_define(kernels.source(), name, value)
    with pytest.raises(RuntimeError,
                       match=r'{} = .*chainer_vgc\.codec has'.format(name)):
        codec.check_kernel_constants(altered)


def test_a_missing_or_unparsable_kernel_constant_fails():
    source = kernels.source()
    missing = source.replace('#define VGC_MAX_D', '#define VGC_MAX_DD')
    with pytest.raises(RuntimeError, match='VGC_MAX_D is not defined'):
        codec.check_kernel_constants(missing)
    odd = _replace_define(source, 'VGC_INDEX_BITS', 'sizeof(int) * 7')
    with pytest.raises(RuntimeError,
                       match='VGC_INDEX_BITS is not an integer constant'):
        codec.check_kernel_constants(odd)


def test_every_definition_is_checked():
    # a second, conflicting definition (say, in another #if branch) fails
    text = kernels.source() + '\n#define VGC_MAX_D 8\n'
    with pytest.raises(RuntimeError, match='VGC_MAX_D = 8'):
        codec.check_kernel_constants(text)


@pytest.mark.parametrize('expr,value', [
    ('28', 28), ('0x0FFFFFFFu', (1 << 28) - 1), ('(-(1 << 30))', -(1 << 30)),
    ('7 /* d */', 7), ('7UL // d', 7), ('010', 8), ('~0 & 0xFF', 255),
    ('__device__ __forceinline__', None), ('1.5', None), ('f(2)', None),
    ('08', None),
])
def test_c_integer_expressions(expr, value):
    assert c_int(expr) == value


def test_wire_constants_are_defined_once():
    """chainer_vgc.backends.cuda.kernels (device primitives; codec builds on it) holds no
    copy of the wire-format constants: they live in chainer_vgc.codec."""
    for name in dir(codec.constants):
        if name.isupper():
            assert not hasattr(kernels, name), name


def test_device_step_fault_flags_are_the_native_backends():
    """The whole-model GPU step reports faults with the native backend's
    flags (GradientCompressor.fault_of reads both)."""
    defined = dict(re.findall(r'#define (VGC_FLAG_\w+) (\w+)u',
                              kernels.source()))
    assert {k: int(v) for k, v in defined.items()} == {
        'VGC_FLAG_BAD_GRAD': bindings.BAD_GRAD,
        'VGC_FLAG_BAD_SQSUM': bindings.BAD_SQSUM,
        'VGC_FLAG_OVERFLOW_R': bindings.OVERFLOW_R,
        'VGC_FLAG_OVERFLOW_V': bindings.OVERFLOW_V}
