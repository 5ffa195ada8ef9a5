import os

import hypothesis
import pytest

hypothesis.settings.register_profile(
    'vgc', deadline=None, max_examples=int(os.environ.get('VGC_EXAMPLES',
                                                          '40')),
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile('vgc')


@pytest.fixture(scope='session')
def host_kernels(tmp_path_factory):
    """The kernels of kernels/vgc_numerics.cuh, compiled for the CPU."""
    import kernel_harness
    try:
        return kernel_harness.HostKernels(
            workdir=str(tmp_path_factory.mktemp('host_kernels')))
    except RuntimeError as e:  # no g++: the suite cannot check the kernels
        pytest.fail(str(e))


@pytest.fixture
def kernel_backend(host_kernels, monkeypatch):
    """Routes the rules' and codec's CuPy branches to the host-compiled
    kernels, so the GPU code path runs end to end on NumPy arrays."""
    from chainer_vgc import backend
    from chainer_vgc import kernels
    monkeypatch.setattr(backend, 'is_cupy', lambda xp: True)
    monkeypatch.setattr(kernels, 'get_kernel',
                        lambda name: (lambda *a: host_kernels(name, *a)))
    return host_kernels
