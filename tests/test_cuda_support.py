"""The installed CuPy with Chainer 7.8.1: imports, version check, NVRTC, and
the CuPy kernel objects of chainer_vgc.kernels (built, not launched: no GPU
is needed)."""

import os
import types

import numpy
import pytest

try:
    import cupy
except Exception as e:  # ImportError, or a CUDA library missing at import
    pytest.skip('CuPy is not importable ({}: {}); install it with '
                "pip install 'chainer-vgc[cuda]'".format(type(e).__name__, e),
                allow_module_level=True)

from chainer_vgc import cuda_support
from chainer_vgc import kernels


def test_chainer_cuda_backend_imports_with_this_cupy():
    from chainer.backends import cuda
    assert isinstance(cuda.available, bool)
    if not cuda.available:  # e.g. no libcublas on a machine without CUDA
        assert isinstance(str(cuda._resolution_error), str)
        assert str(cuda._resolution_error)


def test_check_cupy_accepts_installed_version():
    version = cuda_support.check_cupy(cupy)
    assert version == cuda_support.parse_version(cupy.__version__)
    lo, hi = cuda_support.SUPPORTED_CUPY
    assert lo <= version[0] < hi


@pytest.mark.parametrize('text, expected', [
    ('13.6.0', (13, 6, 0)),
    ('13.0.0rc1', (13, 0, 0)),
    ('14.0.0a1', (14, 0, 0)),
    ('7.8.0', (7, 8, 0)),
    ('13', (13, 0, 0)),
])
def test_parse_version(text, expected):
    assert cuda_support.parse_version(text) == expected


@pytest.mark.parametrize('version', ['7.8.0', '14.0.0', '14.0.0a1', '12.3.0'])
def test_check_cupy_rejects_unsupported_majors(version):
    fake = types.SimpleNamespace(__version__=version)
    with pytest.raises(RuntimeError) as info:
        cuda_support.check_cupy(fake)
    message = str(info.value)
    assert version in message
    assert '>=13,<14' in message
    assert "pip install 'chainer-vgc[cuda]'" in message
    assert "pip install 'cupy-cuda12x>=13,<14'" in message


def test_check_cupy_accepts_prerelease_of_supported_major():
    fake = types.SimpleNamespace(__version__='13.0.0rc1')
    assert cuda_support.check_cupy(fake) == (13, 0, 0)


def test_check_cupy_rejects_module_without_version():
    with pytest.raises(RuntimeError, match='unknown version'):
        cuda_support.check_cupy(types.SimpleNamespace())


def test_preload_nvrtc_loads_the_wheel_library_once():
    path = cuda_support.preload_nvrtc()
    assert path is not None, cuda_support.status()['nvrtc_error']
    assert os.path.isfile(path)
    assert os.path.basename(path).startswith('libnvrtc.so.')
    assert cuda_support.preload_nvrtc() == path  # idempotent
    # CuPy now finds NVRTC by its soname (no GPU needed for this call)
    from cupy_backends.cuda.libs import nvrtc
    assert nvrtc.getVersion()[0] == 12


def test_status_describes_the_setup():
    info = cuda_support.status()
    assert info['cupy_version'] == cupy.__version__
    assert info['cupy_import_error'] is None
    assert info['cupy_supported'] is True
    assert info['cupy_supported_range'] == '>=13,<14'
    assert isinstance(info['chainer_cuda_available'], bool)
    if not info['chainer_cuda_available']:
        assert isinstance(info['chainer_cuda_error'], str)
    assert info['nvrtc_path'] == cuda_support.preload_nvrtc()


def _expected_params(text, is_const):
    """(name, raw, dtype or None, ctype placeholder or None, is_const) of
    each parameter of a CuPy parameter string such as 'G g, raw S r'."""
    out = []
    for item in text.split(','):
        words = item.split()
        raw = words[0] == 'raw'
        if raw:
            words = words[1:]
        type_name, name = words
        try:  # a NumPy type name: 'bool', 'int8', 'float32', ...
            dtype = numpy.dtype(type_name)
            concrete = dtype.name == type_name
        except TypeError:
            concrete = False
        if concrete:
            dtype, placeholder = dtype.type, None
        else:  # a type placeholder such as G, S, T ('G' is also complex256's
            dtype, placeholder = None, type_name  # NumPy code: not a name)
        out.append((name, raw, dtype, placeholder, is_const))
    return out


def _actual_params(params):
    return [(p.name, p.raw, p.dtype, p.ctype if p.dtype is None else None,
             p.is_const) for p in params]


def _check_params(kernel, spec):
    assert (_actual_params(kernel.in_params)
            == _expected_params(spec.in_params, True))
    assert (_actual_params(kernel.out_params)
            == _expected_params(spec.out_params, False))
    if isinstance(kernel, cupy.ElementwiseKernel):
        # params: in, out, then CuPy's own (the index _ind); a
        # ReductionKernel fills its params only when first called
        names = [p.name for p in kernel.params]
        declared = [p.name for p in kernel.in_params + kernel.out_params]
        assert names[:len(declared)] == declared


@pytest.mark.parametrize('name', list(kernels.SPECS))
def test_elementwise_kernel_objects_match_specs(name):
    spec = kernels.SPECS[name]
    kernel = kernels.get_kernel(name)
    assert isinstance(kernel, cupy.ElementwiseKernel)
    assert kernel.name == name
    _check_params(kernel, spec)
    assert kernel.operation == spec.operation
    assert kernel.preamble == kernels.source()
    assert tuple(kernel.kwargs.get('options', ())) == kernels.NVRTC_OPTIONS
    assert kernels.get_kernel(name) is kernel  # built once


_REDUCTION_SPECS = getattr(kernels, 'REDUCTION_SPECS', {})


@pytest.mark.skipif(not _REDUCTION_SPECS,
                    reason='chainer_vgc.kernels has no REDUCTION_SPECS')
@pytest.mark.parametrize('name', list(_REDUCTION_SPECS) or ['(none)'])
def test_reduction_kernel_objects_match_specs(name):
    spec = _REDUCTION_SPECS[name]
    kernel = kernels.get_kernel(name)
    assert isinstance(kernel, cupy.ReductionKernel)
    assert kernel.name == name
    _check_params(kernel, spec)
    # the spec's other fields (map_expr, reduce_expr, post_map_expr,
    # identity, reduce_type, ...) are the kernel's attributes of that name
    for field in getattr(spec, '_fields', ()):
        if field in ('in_params', 'out_params') or not hasattr(kernel, field):
            continue
        assert getattr(kernel, field) == getattr(spec, field), field
    assert kernels.get_kernel(name) is kernel


def test_every_kernel_name_is_in_one_table():
    assert not set(kernels.SPECS) & set(_REDUCTION_SPECS)
