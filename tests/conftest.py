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


@pytest.fixture(scope='session')
def host_kernels_checked(tmp_path_factory):
    """As ``host_kernels``, with every raw array bounds-checked
    (``kernel_harness.HostKernels(checked=True)``): a kernel call that
    reads or writes outside one raises ``AssertionError``."""
    import kernel_harness
    try:
        return kernel_harness.HostKernels(
            workdir=str(tmp_path_factory.mktemp('host_kernels_checked')),
            checked=True)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture
def device(host_kernels, monkeypatch):
    """The GPU code path on the CPU: chainer_vgc sees a fake CuPy whose
    arrays are not NumPy arrays and whose every host<->device copy is
    recorded (tests/fake_cupy.py), and the CuPy kernels run as the
    host-compiled kernels of kernels/vgc_numerics.cuh.  Returns the fake
    module: ``device.asarray(x)`` puts x on the "device"."""
    return _fake_device(host_kernels, monkeypatch)


@pytest.fixture
def checked_device(host_kernels_checked, monkeypatch):
    """``device`` with the kernels run through ``host_kernels_checked``:
    any kernel launch that indexes a raw array out of its bounds fails the
    test with ``AssertionError``."""
    return _fake_device(host_kernels_checked, monkeypatch)


def _fake_device(host_kernels, monkeypatch):
    """The fake CuPy installed, ``kernels.get_kernel`` answering with
    launchers that run the kernels through ``host_kernels`` (a
    ``kernel_harness.HostKernels``) on the device arrays' NumPy data;
    returns the fake module."""
    import fake_cupy
    import kernel_harness
    from chainer_vgc.backends.cuda import kernels
    fake = fake_cupy.install(monkeypatch)

    def get_kernel(name):
        if name in kernels.REDUCTION_SPECS:
            def reduce(x, axis=None, out=None):
                assert axis == 0, 'the harness reduces axis 0 only'
                fake.launch(name)
                got = host_kernels.reduce_axis0(name, x._a)
                if out is None:
                    return fake_cupy.DeviceArray(fake, got)
                assert out.shape == got.shape and out.dtype == got.dtype
                out._a[...] = got  # (CuPy writes out: same type, shape)
                return out
            return reduce

        def launch(*args):
            fake.launch(name)
            host, shape = [], ()
            for a in args:
                if isinstance(a, fake_cupy.DeviceArray):
                    fake._check_device(a)  # launched on the current device
                    # element by element: any contiguous shape, flat
                    assert a._a.flags.c_contiguous
                    host.append(a._a.reshape(-1))
                    shape = a.shape
                else:  # CuPy refuses host arrays as kernel arguments
                    fake_cupy._reject_host(a)
                    host.append(a)
            outs = host_kernels(name, *host)
            n_in = len(kernel_harness.parse_params(
                kernels.SPECS[name].in_params))
            given = args[n_in:]  # outputs passed in are written in place
            result = [given[k] if k < len(given) else
                      fake_cupy.DeviceArray(fake, o.reshape(shape))
                      for k, o in enumerate(outs)]
            return tuple(result)
        return launch
    monkeypatch.setattr(kernels, 'get_kernel', get_kernel)
    return fake
