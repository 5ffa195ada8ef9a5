"""The installed CuPy with Chainer 7.8.1: imports, version check (CuPy 13
on the numpy 1.x stack, CuPy 14 on the NumPy 2 stack), NVRTC discovery and
loading (the CUDA 12 and CUDA 13 wheels, also on fake directory layouts),
and the CuPy kernel objects of chainer_vgc.backends.cuda.kernels (built, not launched: no
GPU is needed)."""

import configparser
import importlib
import importlib.metadata
import os
import sys
import types

import numpy
import pytest
from packaging.requirements import Requirement

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

try:
    import cupy
except Exception as e:  # ImportError, or a CUDA library missing at import
    pytest.skip('CuPy is not importable ({}: {}); install it with '
                "pip install 'chainer-vgc[cuda]'".format(type(e).__name__, e),
                allow_module_level=True)

from chainer_vgc.backends.cuda import support as cuda_support
from chainer_vgc.backends.cuda import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the two stacks: Python, CuPy requirement, NVRTC wheel requirement
#: (Python, CuPy, NVRTC wheel, CUDA runtime headers wheel) of each stack
STACKS = [((3, 11), 'cupy-cuda12x>=13,<14', 'nvidia-cuda-nvrtc-cu12>=12,<13',
           'nvidia-cuda-runtime-cu12>=12,<13'),
          ((3, 12), 'cupy-cuda13x>=14,<15', 'nvidia-cuda-nvrtc>=13,<14',
           'nvidia-cuda-runtime>=13,<14')]


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


def test_installed_cupy_is_the_one_this_python_gets():
    """The venv's CuPy is the wheel the hint (and the cuda extra) installs
    on this Python, and is built for the CUDA its name says."""
    cupy_req = Requirement(cuda_support.stack_requirements()[0])
    assert importlib.metadata.version(cupy_req.name) == cupy.__version__
    assert cupy_req.specifier.contains(cupy.__version__)
    # cupy-cuda12x -> CUDA 12, cupy-cuda13x -> CUDA 13
    assert cupy_req.name == 'cupy-cuda{}x'.format(
        cuda_support.cupy_cuda_major())


@pytest.mark.parametrize('text, expected', [
    ('13.6.0', (13, 6, 0)),
    ('13.0.0rc1', (13, 0, 0)),
    ('14.0.0a1', (14, 0, 0)),
    ('14.2.0', (14, 2, 0)),
    ('7.8.0', (7, 8, 0)),
    ('13', (13, 0, 0)),
])
def test_parse_version(text, expected):
    assert cuda_support.parse_version(text) == expected


@pytest.mark.parametrize('version, expected', [
    ('13.6.0', (13, 6, 0)),
    ('13.0.0rc1', (13, 0, 0)),
    ('14.0.0a1', (14, 0, 0)),
    ('14.2.0', (14, 2, 0)),
])
def test_check_cupy_accepts_cupy_13_and_14(version, expected):
    fake = types.SimpleNamespace(__version__=version)
    assert cuda_support.check_cupy(fake) == expected


@pytest.mark.parametrize('version', ['7.8.0', '12.3.0', '15.0.0',
                                     '15.0.0a1'])
def test_check_cupy_rejects_unsupported_majors(version):
    fake = types.SimpleNamespace(__version__=version)
    with pytest.raises(RuntimeError) as info:
        cuda_support.check_cupy(fake)
    message = str(info.value)
    assert version in message
    assert '>=13,<15' in message
    # the fix for this interpreter: the extra, or its stack's two wheels
    reqs = cuda_support.stack_requirements()
    assert len(reqs) == 3
    assert "pip install 'chainer-vgc[cuda]'" in message
    assert ' '.join("'{}'".format(r) for r in reqs) in message


def test_check_cupy_rejects_module_without_version():
    with pytest.raises(RuntimeError, match='unknown version'):
        cuda_support.check_cupy(types.SimpleNamespace())


@pytest.mark.parametrize('python, cupy_req, nvrtc_req, runtime_req', STACKS)
def test_install_hint_names_the_wheels_of_each_stack(python, cupy_req,
                                                     nvrtc_req, runtime_req):
    reqs = (cupy_req, nvrtc_req, runtime_req)
    assert cuda_support.stack_requirements(python) == reqs
    assert cuda_support.stack_requirements(python + (7,)) == reqs
    hint = cuda_support.install_hint(python)
    assert hint == ("pip install 'chainer-vgc[cuda]' (or pip install "
                    "'{}' '{}' '{}')".format(*reqs))
    other = [s for s in STACKS if s[0] != python][0]
    assert not [r for r in other[1:] if r in hint]


def test_install_hint_is_this_interpreters():
    assert cuda_support.INSTALL_HINT == cuda_support.install_hint(
        sys.version_info[:2])
    expected = STACKS[0] if sys.version_info[:2] < (3, 12) else STACKS[1]
    for req in expected[1:]:
        assert req in cuda_support.INSTALL_HINT


@pytest.mark.parametrize('python, cupy_req, nvrtc_req, runtime_req', STACKS)
def test_stack_requirements_are_the_cuda_extra_of_setup_cfg(
        python, cupy_req, nvrtc_req, runtime_req):
    """What the hint names is what ``pip install 'chainer-vgc[cuda]'``
    installs on that Python (setup.cfg's python_version markers)."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, 'setup.cfg'))
    env = {'python_version': '{}.{}'.format(*python),
           'python_full_version': '{}.{}.0'.format(*python)}
    extra = [Requirement(line) for line in
             cfg.get('options.extras_require', 'cuda').splitlines()
             if line.strip() and not line.strip().startswith('#')]
    chosen = {(r.name, r.specifier) for r in extra
              if r.marker is None or r.marker.evaluate(env)}
    hinted = {(r.name, r.specifier) for r in map(Requirement,
                                                   (cupy_req, nvrtc_req,
                                                   runtime_req))}
    assert chosen == hinted


# ---- NVRTC and CUDA headers of this stack ----------------------------------

def test_cupy_cuda_major_follows_the_stack():
    # CuPy 13 (cupy-cuda12x): CUDA 12; CuPy 14 (cupy-cuda13x): CUDA 13
    major = cuda_support.parse_version(cupy.__version__)[0]
    assert cuda_support.cupy_cuda_major() == {13: 12, 14: 13}[major]


def test_preload_nvrtc_loads_the_wheel_library_once():
    path = cuda_support.preload_nvrtc()
    assert path is not None, cuda_support.status()['nvrtc_error']
    assert os.path.isfile(path)
    major = cuda_support.cupy_cuda_major()
    assert os.path.basename(path) == 'libnvrtc.so.{}'.format(major)
    libdir = os.path.join('nvidia', cuda_support.NVRTC_WHEELS[major][1])
    assert os.path.dirname(path).endswith(os.sep + libdir)
    assert cuda_support.find_nvrtc() == path
    assert cuda_support.preload_nvrtc() == path  # idempotent
    # CuPy now finds NVRTC, of its CUDA's major version (no GPU needed)
    from cupy_backends.cuda.libs import nvrtc
    assert nvrtc.getVersion()[0] == major


def test_status_describes_the_setup():
    info = cuda_support.status()
    assert info['cupy_version'] == cupy.__version__
    assert info['cupy_import_error'] is None
    assert info['cupy_supported'] is True
    assert info['cupy_check_error'] is None
    assert info['cupy_supported_range'] == '>=13,<15'
    assert info['cupy_cuda_major'] == cuda_support.cupy_cuda_major()
    assert info['cupy_cuda_major'] in (12, 13)
    assert isinstance(info['chainer_cuda_available'], bool)
    if not info['chainer_cuda_available']:
        assert isinstance(info['chainer_cuda_error'], str)
    assert info['nvrtc_path'] == cuda_support.preload_nvrtc()
    assert info['nvrtc_error'] is None


def test_cupy_finds_the_cuda_headers_its_kernels_include():
    """Every CuPy kernel includes cupy/carray.cuh, which includes
    cuda_fp16.h: one of the -I directories CuPy hands NVRTC (as it would
    for our kernels) must hold it, or no kernel compiles on the GPU."""
    import kernel_harness
    from cupy_backends.cuda.libs import nvrtc
    assert cuda_support.preload_nvrtc() is not None
    options = kernel_harness.cupy_compile_options()
    dirs = [o[2:] for o in options if o.startswith('-I')]
    major, minor = nvrtc.getVersion()
    fix = ({12: "pip install 'nvidia-cuda-runtime-cu12=={}.{}.*' (CuPy 13 "
                'takes the headers of the wheel of NVRTC\'s minor version), '
                'or set CUDA_PATH to a CUDA 12 toolkit',
            13: "pip install 'nvidia-cuda-runtime>=13,<14', or install a "
                'CUDA 13 toolkit (CuPy 14 finds the headers with '
                'cuda-pathfinder)'}.get(major, 'install the CUDA headers')
           .format(major, minor))
    assert any(os.path.isfile(os.path.join(d, 'cuda_fp16.h'))
               for d in dirs), (
        'no cuda_fp16.h in the include directories CuPy {} passes NVRTC '
        '{}.{} ({}); fix: {}'.format(cupy.__version__, major, minor,
                                     ', '.join(dirs), fix))


# ---- NVRTC: fake directory layouts ------------------------------------------

CU12 = ('nvidia', 'cuda_nvrtc', 'lib')  # nvidia-cuda-nvrtc-cu12
CU13 = ('nvidia', 'cu13', 'lib')        # nvidia-cuda-nvrtc (13.x)


def put(site, parts, name, text='not a library'):
    """Create ``site/parts.../name``; its path."""
    d = site.joinpath(*parts)
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)
    return str(d / name)


def _nvidia_modules():
    return [k for k in sys.modules if k == 'nvidia' or k.startswith('nvidia.')]


@pytest.fixture
def sites(tmp_path, monkeypatch):
    """Two empty site directories, ``sys.path`` made of them only (first
    ``a``, then ``b``), and ``nvidia`` not imported: a fake install.  The
    real ``nvidia`` modules are put back afterwards."""
    a, b = tmp_path / 'site-a', tmp_path / 'site-b'
    a.mkdir()
    b.mkdir()
    saved = {k: sys.modules.pop(k) for k in _nvidia_modules()}
    monkeypatch.setattr(sys, 'path', [str(a), str(b)])
    importlib.invalidate_caches()
    yield a, b
    for k in _nvidia_modules():
        del sys.modules[k]
    sys.modules.update(saved)


@pytest.fixture
def fresh_preload(monkeypatch):
    """preload_nvrtc as in a new process (nothing loaded yet); the calls to
    ctypes.CDLL are recorded and answered with a stand-in handle."""
    monkeypatch.setattr(cuda_support, '_nvrtc',
                        {'path': None, 'handle': None, 'error': None})
    calls = []

    def cdll(path, mode=0):
        calls.append((path, mode))
        return object()
    monkeypatch.setattr(cuda_support.ctypes, 'CDLL', cdll)
    return calls


def test_find_nvrtc_cuda12_wheel_layout(sites):
    lib = put(sites[0], CU12, 'libnvrtc.so.12')
    put(sites[0], CU12, 'libnvrtc-builtins.so.12.9')
    assert cuda_support.find_nvrtc(12) == lib
    assert cuda_support.find_nvrtc(13) is None


def test_find_nvrtc_cuda13_wheel_layout(sites):
    lib = put(sites[0], CU13, 'libnvrtc.so.13')
    put(sites[0], CU13, 'libnvrtc-builtins.so.13.5')
    put(sites[0], ('nvidia', 'cu13', 'include'), 'nvrtc.h')
    assert cuda_support.find_nvrtc(13) == lib
    assert cuda_support.find_nvrtc(12) is None


def test_find_nvrtc_with_both_wheels_takes_the_major_asked_for(sites):
    lib12 = put(sites[0], CU12, 'libnvrtc.so.12')
    lib13 = put(sites[0], CU13, 'libnvrtc.so.13')
    assert cuda_support.find_nvrtc(12) == lib12
    assert cuda_support.find_nvrtc(13) == lib13


def test_find_nvrtc_never_returns_another_major(sites):
    # each wheel directory holding only the other major's library
    put(sites[0], CU12, 'libnvrtc.so.13')
    put(sites[0], CU12, 'libnvrtc.so.13.0.88')
    put(sites[0], CU13, 'libnvrtc.so.12')
    put(sites[0], CU13, 'libnvrtc.so.12.9.86')
    assert cuda_support.find_nvrtc(12) is None
    assert cuda_support.find_nvrtc(13) is None


def test_find_nvrtc_takes_the_highest_versioned_file_without_soname(sites):
    put(sites[0], CU12, 'libnvrtc.so.12.1.105')
    newest = put(sites[0], CU12, 'libnvrtc.so.12.9.86')
    put(sites[0], CU12, 'libnvrtc.so.13.0.48')  # not a 12
    assert cuda_support.find_nvrtc(12) == newest


def test_find_nvrtc_searches_every_site_of_the_namespace_package(sites):
    """nvidia is a namespace package: the CUDA 12 wheel may sit in one site
    directory and the CUDA 13 wheel in another."""
    a, b = sites
    lib12 = put(a, CU12, 'libnvrtc.so.12')
    lib13 = put(b, CU13, 'libnvrtc.so.13')
    import nvidia
    assert list(nvidia.__path__) == [str(a / 'nvidia'), str(b / 'nvidia')]
    assert cuda_support.find_nvrtc(12) == lib12
    assert cuda_support.find_nvrtc(13) == lib13


def test_find_nvrtc_sees_past_a_regular_nvidia_package(sites):
    """A wheel that ships nvidia/__init__.py makes nvidia a regular
    package that hides the other site directories from ``import``: the
    wheel there is found all the same."""
    a, b = sites
    put(a, ('nvidia',), '__init__.py', '')
    lib13 = put(b, CU13, 'libnvrtc.so.13')
    import nvidia
    assert list(nvidia.__path__) == [str(a / 'nvidia')]
    assert cuda_support.find_nvrtc(13) == lib13


def test_find_nvrtc_defaults_to_the_cuda_of_the_installed_cupy(
        sites, monkeypatch):
    lib12 = put(sites[0], CU12, 'libnvrtc.so.12')
    lib13 = put(sites[0], CU13, 'libnvrtc.so.13')
    for major, lib in ((12, lib12), (13, lib13)):
        monkeypatch.setattr(cuda_support, 'cupy_cuda_major', lambda: major)
        assert cuda_support.find_nvrtc() == lib
    monkeypatch.setattr(cuda_support, 'cupy_cuda_major', lambda: None)
    assert cuda_support.find_nvrtc() is None  # no CuPy: no NVRTC to find
    assert cuda_support.find_nvrtc(11) is None  # no wheel known for it


@pytest.mark.parametrize('major, parts, wheel, other_major, other_parts', [
    (12, CU12, 'nvidia-cuda-nvrtc-cu12', 13, CU13),
    (13, CU13, 'nvidia-cuda-nvrtc', 12, CU12)])
def test_preload_nvrtc_loads_the_wheel_of_cupys_cuda_once(
        sites, monkeypatch, fresh_preload, major, parts, wheel, other_major,
        other_parts):
    """Both wheels installed: the library of CuPy's CUDA is loaded, once,
    with RTLD_GLOBAL; the other one is not touched."""
    assert cuda_support.NVRTC_WHEELS[major][0] == wheel
    put(sites[0], other_parts, 'libnvrtc.so.{}'.format(other_major))
    lib = put(sites[0], parts, 'libnvrtc.so.{}'.format(major))
    monkeypatch.setattr(cuda_support, 'cupy_cuda_major', lambda: major)
    assert cuda_support.preload_nvrtc() == lib
    assert cuda_support.preload_nvrtc() == lib
    assert fresh_preload == [(lib, cuda_support.ctypes.RTLD_GLOBAL)]
    assert cuda_support._nvrtc['error'] is None


def test_preload_nvrtc_never_loads_another_major(sites, monkeypatch,
                                                 fresh_preload):
    """CuPy 14 (CUDA 13) with only the CUDA 12 wheel installed: nothing is
    loaded, and the error names the wheel that is missing."""
    put(sites[0], CU12, 'libnvrtc.so.12')
    monkeypatch.setattr(cuda_support, 'cupy_cuda_major', lambda: 13)
    assert cuda_support.preload_nvrtc() is None
    assert fresh_preload == []
    error = cuda_support._nvrtc['error']
    assert 'nvidia-cuda-nvrtc is not installed' in error
    assert 'libnvrtc.so.13' in error and 'CUDA 13' in error
    assert cuda_support.INSTALL_HINT in error


def test_preload_nvrtc_without_cupy_loads_nothing(sites, monkeypatch,
                                                  fresh_preload):
    put(sites[0], CU12, 'libnvrtc.so.12')
    put(sites[0], CU13, 'libnvrtc.so.13')
    monkeypatch.setattr(cuda_support, 'cupy_cuda_major', lambda: None)
    assert cuda_support.preload_nvrtc() is None
    assert fresh_preload == []
    assert 'CuPy is not importable' in cuda_support._nvrtc['error']


def test_preload_nvrtc_reports_a_library_that_does_not_load(sites,
                                                            monkeypatch):
    monkeypatch.setattr(cuda_support, '_nvrtc',
                        {'path': None, 'handle': None, 'error': None})
    lib = put(sites[0], CU13, 'libnvrtc.so.13')  # text, not an ELF file
    monkeypatch.setattr(cuda_support, 'cupy_cuda_major', lambda: 13)
    assert cuda_support.preload_nvrtc() is None
    error = cuda_support._nvrtc['error']
    assert error.startswith('OSError: ') and lib in error
    assert cuda_support._nvrtc['handle'] is None  # tried again next call


# ---- the kernel objects -----------------------------------------------------

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


_REDUCTION_SPECS = kernels.REDUCTION_SPECS


@pytest.mark.parametrize('name', list(_REDUCTION_SPECS))
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
