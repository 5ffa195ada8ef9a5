import os

# OpenMP threads that wait block instead of spinning (libgomp reads this
# when the native backend's library is loaded, after this file): the suite
# runs two pytest workers and oversubscribing mpiexec jobs on few cores,
# where a spinning team member holds the core its partner needs, so every
# parallel region of the native passes (two threads by default) waited out
# the scheduler.  The same code runs, with the same threads; only idle
# waiting changes.  Inherited by every subprocess the tests start with this
# environment (mpiexec's ranks, the examples, the runbook).
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')
# each kernel compiled for the host once per test run, whichever process
# asks first (tests/kernel_harness.py), in the checkout's build/ (ignored)
os.environ.setdefault('VGC_HOST_KERNEL_CACHE', os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'build',
    'host_kernels'))

import hypothesis  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile(
    'vgc', deadline=None, max_examples=int(os.environ.get('VGC_EXAMPLES',
                                                          '40')),
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile('vgc')


def xdist_groups(item):
    """The names of the ``xdist_group`` marks on ``item``."""
    return sorted({str(m.args[0] if m.args else m.kwargs.get('name',
                                                             'default'))
                   for m in item.iter_markers('xdist_group')})


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The long runs first (see below).  ``--dist loadgroup``: a test marked ``xdist_group('mpiexec')`` (the
    multi-rank runs, which oversubscribe the cores) runs on the worker of
    its group, one after the other.  pytest-xdist 3.8 tags the test ids
    with their group by setting ``item._nodeid``, which pytest 9 no longer
    reads (its ids live in ``item._id``): every test ran on any worker, two
    mpiexec jobs at once.  This hook tags them where pytest 9 reads."""
    # the long runs first (the mpiexec group, one after the other on one
    # worker, and tests marked `long`), so that the rest runs beside them
    # instead of after them
    items.sort(key=lambda i: not (xdist_groups(i) or
                                  i.get_closest_marker('long')))
    if not getattr(config.option, 'loadgroup', False):
        return
    for item in items:
        names = xdist_groups(item)
        if names and '@' not in item.nodeid:
            tagged = '{}@{}'.format(item.nodeid, '_'.join(names))
            if hasattr(item, '_id'):  # (pytest 9: a structured id)
                from _pytest.nodeid import coerce_node_id
                item._id = coerce_node_id(tagged)
            else:
                item._nodeid = tagged


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
