"""The constants shared with the C++/CUDA sources (``#define VGC_...``):
:data:`C_CONSTANTS` names them once, :func:`check_kernel_constants`
compares a source text with them (the native backend compares its
compiled ones)."""

import ast
import collections
import re

from chainer_vgc.codec.constants import (
    FMT_GAP, FMT_POW2, FMT_QSGD, FMT_RAW, FMT_SPARSE, GAP_ESCAPE,
    GAP_PARAM_WORDS, SPARSE_FLOAT32,
    GAP_RESTARTS, GAP_RESTART_CODES, GAP_RESTART_WORDS, GAP_SIGN_ONLY, GAP_SPAN_SHIFT, HEADER_WORDS, INDEX_BITS,
    LOG2_ZERO, MAGIC, MAX_D, MAX_INDEX, MERGE_MAX_COUNT, QSGD_OFFSET_BITS,
    QSGD_RECORD_WORDS, RAW_DENSE, RAW_FLOAT64)

#: the constants of :mod:`.constants` under the names the C++/CUDA sources
#: ``#define`` them (``kernels/vgc_host_common.h``,
#: ``kernels/vgc_numerics.cuh``)
C_CONSTANTS = collections.OrderedDict([
    ('VGC_MAGIC', MAGIC),
    ('VGC_FMT_POW2', FMT_POW2),
    ('VGC_FMT_RAW', FMT_RAW),
    ('VGC_FMT_QSGD', FMT_QSGD),
    ('VGC_HEADER_WORDS', HEADER_WORDS),
    ('VGC_INDEX_BITS', INDEX_BITS),
    ('VGC_INDEX_MASK', MAX_INDEX - 1),
    ('VGC_MAX_D', MAX_D),
    ('VGC_LOG2_ZERO', LOG2_ZERO),
    ('VGC_RAW_DENSE', RAW_DENSE),
    ('VGC_RAW_FLOAT64', RAW_FLOAT64),
    ('VGC_QSGD_OFFSET_BITS', QSGD_OFFSET_BITS),
    ('VGC_QSGD_RECORD_WORDS', QSGD_RECORD_WORDS),
    ('VGC_FMT_GAP', FMT_GAP),
    ('VGC_GAP_ESCAPE', GAP_ESCAPE),
    ('VGC_GAP_SIGN_ONLY', GAP_SIGN_ONLY),
    ('VGC_GAP_PARAM_WORDS', GAP_PARAM_WORDS),
    ('VGC_GAP_RESTARTS', GAP_RESTARTS),
    ('VGC_GAP_SPAN_SHIFT', GAP_SPAN_SHIFT),
    ('VGC_GAP_RESTART_CODES', GAP_RESTART_CODES),
    ('VGC_GAP_RESTART_WORDS', GAP_RESTART_WORDS),
    ('VGC_MERGE_MAX_COUNT', MERGE_MAX_COUNT),
    ('VGC_FMT_SPARSE', FMT_SPARSE),
    ('VGC_SPARSE_FLOAT32', SPARSE_FLOAT32),
])
#: the ones ``kernels/vgc_numerics.cuh`` (the CuPy kernels' source) defines
KERNEL_CONSTANTS = ('VGC_LOG2_ZERO', 'VGC_INDEX_BITS', 'VGC_INDEX_MASK',
                    'VGC_MAX_D', 'VGC_GAP_ESCAPE', 'VGC_MAGIC',
                    'VGC_FMT_POW2', 'VGC_FMT_RAW', 'VGC_HEADER_WORDS',
                    'VGC_RAW_DENSE', 'VGC_RAW_FLOAT64', 'VGC_FMT_GAP',
                    'VGC_GAP_SIGN_ONLY', 'VGC_GAP_PARAM_WORDS',
                    'VGC_GAP_RESTART_CODES', 'VGC_GAP_RESTART_WORDS',
                    'VGC_GAP_RESTARTS', 'VGC_MERGE_MAX_COUNT')

_DEFINE = re.compile(r'^[ \t]*#[ \t]*define[ \t]+(VGC_\w+)[ \t]+(.*)$',
                     re.MULTILINE)
_C_INT = re.compile(r'\b(0[xX][0-9a-fA-F]+|[0-9]+)[uUlL]*\b')
_C_OPS = {
    ast.USub: lambda x: -x, ast.UAdd: lambda x: x, ast.Invert: lambda x: ~x,
    ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y,
    ast.Mult: lambda x, y: x * y, ast.LShift: lambda x, y: x << y,
    ast.RShift: lambda x, y: x >> y, ast.BitOr: lambda x, y: x | y,
    ast.BitAnd: lambda x, y: x & y, ast.BitXor: lambda x, y: x ^ y,
}


def _c_literal(m):
    digits = m.group(1)
    if digits[:2] in ('0x', '0X'):
        return str(int(digits, 16))
    return str(int(digits, 8 if digits[0] == '0' else 10))


def c_int(expr):
    """Value of a C integer constant expression (literals with ``u``/``l``
    suffixes, parentheses, unary and binary arithmetic and bit operators,
    taken as mathematical integers), or None for anything else."""
    expr = re.sub(r'/\*.*?\*/|//.*$', ' ', expr).strip()
    try:
        tree = ast.parse(_C_INT.sub(_c_literal, expr), mode='eval').body
    except (SyntaxError, ValueError):  # ValueError: a bad octal literal
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _C_OPS:
            return _C_OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _C_OPS:
            return _C_OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(node)
    try:
        return value(tree)
    except ValueError:
        return None


def check_kernel_constants(source_text, names=KERNEL_CONSTANTS):
    """Check the ``#define VGC_...`` lines of a C++/CUDA source against
    codec: ``source_text`` (``kernels/vgc_numerics.cuh``, as
    :func:`chainer_vgc.backends.cuda.kernels.source` reads it, for the default ``names``)
    must define each of ``names`` (keys of :data:`C_CONSTANTS`) as an
    integer constant expression equal to codec's value, every time it
    defines it.

    Returns ``{name: value}``; raises RuntimeError listing every constant
    that is missing, not an integer expression, or different.
    """
    found = collections.OrderedDict()
    problems = []
    for m in _DEFINE.finditer(source_text):
        name, value = m.group(1), c_int(m.group(2))
        if name not in names:
            continue
        want = C_CONSTANTS[name]
        if value is None:
            problems.append('{} is not an integer constant ({!r})'.format(
                name, m.group(2).strip()))
        elif value != want:
            problems.append('{} = {}, chainer_vgc.codec has {}'.format(
                name, value, want))
        found[name] = value
    problems += ['{} is not defined'.format(n) for n in names
                 if n not in found]
    if problems:
        raise RuntimeError(
            'chainer_vgc: the kernel source and chainer_vgc.codec disagree '
            'on wire-format constants: {}'.format('; '.join(problems)))
    return found
