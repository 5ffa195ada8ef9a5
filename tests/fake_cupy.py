"""A CPU stand-in for the part of CuPy that chainer_vgc's GPU path uses.

:class:`FakeCupy` is a module-like object over NumPy whose arrays
(:class:`DeviceArray`) are *not* NumPy arrays, so that every crossing between
"host" and "device" has to be explicit, as with CuPy, and is recorded::

    fake = FakeCupy()
    monkeypatch.setattr(backend, 'cupy', fake)     # or install(monkeypatch)
    ...run the GPU code path...
    assert fake.count('download') <= 1 and fake.count('scalar') == 0

``fake.log`` holds ``(kind, nbytes, note)`` records, kind being ``'upload'``
(host to device), ``'download'`` (device to host) or ``'scalar'`` (a device
value read into Python: ``int()``, ``float()``, ``bool()``, ``.item()``,
``.tolist()``, ``operator.index``).  Everything else (creation, arithmetic,
indexing with device arrays, device-to-device copies) moves no data between
host and device.

``fake.launches`` lists the kernel launches, by name: what CuPy runs as a
kernel (a ufunc, a reduction, a fill, a cast, a copy, a gather or scatter
through an advanced index, a function such as ``nonzero`` or ``cumsum``,
and the ElementwiseKernels, which the ``device`` fixture records) counts
one each; views, basic slicing and ``empty`` count nothing.  Two of
CuPy's functions are counted as CuPy issues them, read from its source
(``cupy/_core/_routines_manipulation.pyx``, ``_routines_math.pyx``):

- ``concatenate``: more than :data:`CONCAT_MIN_INPUTS` inputs, all of the
  output's dtype, averaging under :data:`CONCAT_THRESHOLD` bytes, take one
  kernel over a table of their pointers, which is uploaded (with two more
  tables, offsets and strides, unless every input is C-contiguous and of
  one shape); any other call takes one copy kernel per non-empty input
  (``'concatenate.copy'``).
- ``cumsum`` (function or method, flat): without CUB, ``scan`` takes one
  kernel for up to :data:`SCAN_CHUNK` elements, else a block-sum kernel,
  the scan of the block sums (recursively) and a scan kernel; with
  ``fake.accelerators = ('cub',)`` (``CUPY_ACCELERATORS=cub``, the
  default of recent CuPy, ``cupy/_core/_gpu/_accelerator.pyx``) a cast
  copy and CUB's two scan kernels.  With ``out=``, one copy into it
  first.

``fake.cuda.cub.cub_scan(a, CUPY_CUB_CUMSUM)`` scans ``a`` in place with
CUB's two kernels (``'cub.init'``, ``'cub.scan'``), as CuPy's
``cupy/cuda/cub.pyx`` does for a supported dtype (else it returns None
and does nothing); ``fake.cuda.cub = None`` stands for a CuPy without it.

The thresholds are attributes of the fake (``fake.concat_threshold``,
``fake.scan_chunk``), so a test may scale them down with its tensors.
Other CuPy functions may take more than one kernel (``nonzero`` takes a
scan and a scatter), so the count is a lower bound for them and exact for
the ElementwiseKernels.  ``fake.count('launch')`` is their number.

Where CuPy would quietly do a transfer that the code under test should not
rely on, the fake is stricter: a host ``numpy.ndarray`` (ndim > 0) given to a
device function, a ufunc or as an index raises ``TypeError``, and NumPy API
functions (``numpy.concatenate`` ...) on device arrays raise ``TypeError``
instead of dispatching to CuPy, as a sign of a host path taken by mistake.
No real CuPy or GPU is involved.
"""

import numbers
import operator
import weakref

import numpy
from numpy.lib.mixins import NDArrayOperatorsMixin

KINDS = ('upload', 'download', 'scalar')
#: what ``count`` counts besides the transfers
LAUNCH = 'launch'
#: functions that launch no kernel (allocation only)
_ALLOCATING = ('empty', 'empty_like')
#: DeviceArray methods that return a view (no kernel)
_VIEWS = ('reshape', 'ravel', 'view', 'transpose', 'swapaxes', 'squeeze')

#: module-level functions that exist (anything else: AttributeError)
FUNCTIONS = (
    'empty', 'zeros', 'ones', 'full', 'empty_like', 'zeros_like',
    'ones_like', 'full_like', 'arange', 'nonzero', 'where', 'flatnonzero',
    'repeat', 'diff', 'cumsum', 'unique', 'abs', 'sqrt', 'floor', 'clip',
    'signbit', 'isfinite', 'minimum', 'maximum', 'ascontiguousarray',
    'searchsorted', 'sort', 'argsort', 'take', 'add', 'logical_and',
    'logical_or', 'count_nonzero', 'sum', 'any', 'all', 'einsum', 'matmul',
    'partition')
#: functions whose array operands must all be device arrays
_SEQUENCE_FUNCTIONS = ('concatenate', 'stack')
#: CuPy's ``_concatenate``: one kernel for more than this many inputs ...
CONCAT_MIN_INPUTS = 8
#: ... when they average under this many bytes (``threshold_size``)
CONCAT_THRESHOLD = 2 * 1024 * 1024
#: CuPy's ``scan`` without CUB: elements a thread block scans
SCAN_CHUNK = 512
#: ``cupy.cuda.cub``'s op code of an inclusive sum, and the dtypes its scan
#: takes (CUB_support_dtype, float16 aside)
CUPY_CUB_CUMSUM = 5
_CUB_DTYPES = tuple(numpy.dtype(d) for d in (
    numpy.int8, numpy.uint8, numpy.int16, numpy.uint16, numpy.int32,
    numpy.uint32, numpy.int64, numpy.uint64, numpy.float32, numpy.float64))
#: DeviceArray methods computed by NumPy on the wrapped data
_METHODS = (
    'reshape', 'ravel', 'view', 'copy', 'transpose', 'swapaxes', 'squeeze',
    'flatten', 'min', 'max', 'sum', 'prod', 'mean', 'var', 'std', 'any',
    'all', 'argmax', 'argmin', 'cumsum', 'dot', 'nonzero', 'clip', 'round',
    'repeat', 'take')
_DTYPES = ('float16', 'float32', 'float64', 'int8', 'int16', 'int32',
           'int64', 'uint8', 'uint16', 'uint32', 'uint64', 'bool_', 'dtype')


def _reject_host(x):
    if isinstance(x, numpy.ndarray) and x.ndim > 0:
        raise TypeError(
            'Unsupported type {}: a host array (shape {}) given where a '
            'device array is needed'.format(type(x), x.shape))


def _unwrap(x, strict=None):
    """The NumPy data behind ``x``: device arrays (in lists, tuples and
    dicts too) unwrapped; host arrays with ndim > 0 rejected."""
    if isinstance(x, DeviceArray):
        if strict is not None:
            strict(x)
        return x._a
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, strict) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, strict) for k, v in x.items()}
    _reject_host(x)
    return x


def _advanced(key):
    """Whether indexing with ``key`` gathers (an array or list index, as
    opposed to integers and slices, which give a view)."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (DeviceArray, list, numpy.ndarray)) for k in keys)


def _root(a):
    """The array owning the memory that ``a`` views."""
    while isinstance(a.base, numpy.ndarray):
        a = a.base
    return a


def _scalar_read(note, read):
    """A DeviceArray method reading device data into Python, recorded as
    ``'scalar'`` (after ``read`` succeeded: bool() of a size > 1 array
    raises and reads nothing)."""
    def method(self, *args):
        value = read(self._a, *args)
        self._fake._record('scalar', self.nbytes, note)
        return value
    method.__name__ = note
    return method


class FakeDevice(object):
    """A CUDA device: ``with Device(1):`` makes it current; ``Device()`` is
    the current one.  Subclassed per :class:`FakeCupy` (``fake.cuda.Device``),
    which sets ``_fake``."""

    _fake = None

    def __init__(self, device=None):
        self.id = self._fake._current if device is None else int(device)
        self._saved = []

    def _check(self):
        if not 0 <= self.id < self._fake.n_devices:
            raise RuntimeError('cudaErrorInvalidDevice: invalid device '
                               'ordinal {}'.format(self.id))

    def use(self):
        self._check()
        self._fake._current = self.id

    def __enter__(self):
        self._check()
        self._saved.append(self._fake._current)
        self._fake._current = self.id
        return self

    def __exit__(self, *exc):
        self._fake._current = self._saved.pop()

    def __eq__(self, other):
        return isinstance(other, FakeDevice) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return '<CUDA Device {}>'.format(self.id)


#: the ufuncs CuPy compiles with -ftz=true that chainer_vgc might call
_FLUSHING = (numpy.add, numpy.subtract, numpy.multiply, numpy.true_divide,
             numpy.negative)


def _flush(x):
    """float32 subnormals of ``x`` as signed zeros (a copy); anything else
    as it is."""
    if not (isinstance(x, (numpy.ndarray, numpy.generic))
            and x.dtype == numpy.float32):
        return x
    x = numpy.array(x)
    tiny = numpy.finfo(numpy.float32).tiny
    sub = (x != 0) & (numpy.abs(x) < tiny)
    x[sub] = numpy.copysign(numpy.float32(0), x[sub])
    return x


class DeviceArray(NDArrayOperatorsMixin):
    """A "device" array: NumPy data ``_a`` on device ``_dev`` of ``_fake``.
    Results of operations stay on the device (reductions as 0-d arrays);
    only :meth:`get`, ``fake.asnumpy`` and the scalar reads leave it."""

    def __init__(self, fake, a, dev=None):
        self._fake = fake
        self._a = a
        self._dev = fake._current if dev is None else dev
        #: the device array whose memory this one views (CuPy's ``base``:
        #: the owner, never a view), None for an owner
        self._owner = None

    # -- attributes --------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self._fake._wrap(self._a.T, (self,)))

    @property
    def device(self):
        return self._fake.cuda.Device(self._dev)

    @property
    def base(self):
        return self._owner

    @property
    def data(self):
        """CuPy's MemoryPointer, as far as ``ptr`` (the address)."""
        ptr = self._a.__array_interface__['data'][0]
        return _Namespace(ptr=ptr)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError('iteration over a 0-d array')
        return (self[i] for i in range(len(self)))

    def __repr__(self):  # free, so that debugging does not move the counts
        return 'DeviceArray({!r}, device={})'.format(self._a, self._dev)

    def __copy__(self, memo=None):  # a device copy on the array's device
        self._fake.launch('copy')
        return DeviceArray(self._fake, self._a.copy(), self._dev)

    __deepcopy__ = __copy__

    # -- computation -------------------------------------------------------
    def __getattr__(self, name):
        if name in _METHODS:
            def method(*args, **kwargs):
                result = self._fake._call(getattr(self._a, name), args,
                                          kwargs, keep=(self,))
                if name not in _VIEWS or not (
                        isinstance(result, DeviceArray)
                        and _root(result._a) is _root(self._a)):
                    self._fake._launch_call(name, (self,) + args, kwargs)
                return result
            return method
        raise AttributeError('DeviceArray has no attribute {!r}'.format(name))

    def astype(self, dtype, copy=True, **kwargs):
        if not copy and self.dtype == numpy.dtype(dtype):
            return self
        self._fake.launch('astype')
        out = self._a.astype(dtype, **kwargs)
        if self._fake.ftz:
            out = _flush(out)
        return self._fake._wrap(out)

    def fill(self, value):
        self._fake.launch('fill')
        self._a.fill(_unwrap(value))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fake = self._fake
        for i, x in enumerate(inputs):  # CuPy takes no lists (but indices)
            if isinstance(x, (list, tuple)) and not (method == 'at' and i):
                raise TypeError('Unsupported type {} in {}'.format(
                    type(x), ufunc.__name__))
        args = _unwrap(inputs, fake._check_device)
        outs = kwargs.pop('out', None)
        kwargs = _unwrap(kwargs)
        if outs is not None:
            if not all(isinstance(o, DeviceArray) for o in outs):
                raise TypeError('out must be a device array')
            kwargs['out'] = _unwrap(outs, fake._check_device)
        fake.launch(ufunc.__name__ + ('' if method == '__call__'
                                      else '.' + method))
        flushing = fake.ftz and ufunc in _FLUSHING
        if flushing:
            args = tuple(_flush(a) for a in args)
        result = getattr(ufunc, method)(*args, **kwargs)
        if flushing:
            for o in kwargs.get('out') or ():
                o[...] = _flush(o)
            if method != 'at' and isinstance(result, numpy.ndarray):
                result = _flush(result)
        if method == 'at':
            return None
        if outs is not None:
            return outs[0] if len(outs) == 1 else outs
        return fake._wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        return NotImplemented  # numpy.concatenate(device arrays): TypeError

    def __array__(self, dtype=None):
        raise TypeError(
            'Implicit conversion to a NumPy array is not allowed. Please use '
            '`.get()` to construct a NumPy array explicitly.')

    # -- indexing ----------------------------------------------------------
    def _index(self, key):
        if isinstance(key, tuple):
            return tuple(self._index(k) for k in key)
        if isinstance(key, DeviceArray):
            self._fake._check_device(key)
            return key._a
        if isinstance(key, numpy.ndarray) and key.ndim > 0:
            raise TypeError('a host numpy.ndarray cannot index a device '
                            'array (upload it with asarray first)')
        if isinstance(key, list):  # CuPy uploads a list index
            return self._fake.asarray(key)._a
        return key

    def __getitem__(self, key):
        if _advanced(key):
            self._fake.launch('getitem')  # a gather
        return self._fake._wrap(self._a[self._index(key)], (self,))

    def __setitem__(self, key, value):
        self._fake.launch('setitem')
        if isinstance(value, DeviceArray):
            self._fake._check_device(value)
            value = value._a
        elif isinstance(value, (list, numpy.ndarray)) and numpy.ndim(value):
            value = self._fake.asarray(value)._a  # an upload, as CuPy does
        self._a[self._index(key)] = value

    # -- leaving the device ------------------------------------------------
    def get(self, stream=None, order='C', out=None, blocking=True):
        """Download: a new host array, or ``out`` filled in place."""
        self._fake._record('download', self.nbytes, 'get')
        if out is None:
            return numpy.array(self._a, order=order)
        if not isinstance(out, numpy.ndarray) or out.shape != self.shape:
            raise ValueError('out must be a host array of shape {}'.format(
                self.shape))
        numpy.copyto(out, self._a)
        return out

    item = _scalar_read('item', numpy.ndarray.item)
    tolist = _scalar_read('tolist', numpy.ndarray.tolist)
    __int__ = _scalar_read('int', int)
    __float__ = _scalar_read('float', float)
    __bool__ = _scalar_read('bool', bool)
    __index__ = _scalar_read('index', operator.index)


class _Function(object):
    """``fake.<name>``: NumPy's ``<name>`` on unwrapped device arrays, the
    results wrapped back; ufunc methods (``add.at``, ``add.reduce``) too."""

    def __init__(self, fake, func, name, allow_host=False):
        self._fake, self._func, self.__name__ = fake, func, name
        self._allow_host = allow_host

    def __call__(self, *args, **kwargs):
        if self.__name__ in _SEQUENCE_FUNCTIONS:
            arrays = args[0] if args else kwargs.get('arrays', ())
            if not all(isinstance(a, DeviceArray) for a in arrays):
                raise TypeError('{} accepts only device arrays'.format(
                    self.__name__))
        if self.__name__ not in _ALLOCATING:
            self._fake._launch_call(self.__name__, args, kwargs)
        if self._allow_host and args and isinstance(args[0], numpy.ndarray):
            # *_like of a host prototype: only its shape and dtype are read
            return self._fake._call(self._func, args[1:], kwargs,
                                    first=args[0])
        return self._fake._call(self._func, args, kwargs)

    def __getattr__(self, method):
        inner = getattr(self._func, method)  # AttributeError if none
        if not callable(inner):
            return inner
        return _Function(self._fake, inner, self.__name__ + '.' + method)

    def __repr__(self):
        return '<fake cupy function {}>'.format(self.__name__)


class _Namespace(object):
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class _BitGenerator(object):
    """``cupy.random.Philox4x3210`` / ``XORWOW``: holds the seed (the fake's
    generators all draw NumPy's stream for it)."""

    def __init__(self, seed=None, size=-1):
        self.seed = seed


class _Generator(object):
    """``cupy.random.Generator`` over ``numpy.random.default_rng(seed)``."""

    def __init__(self, fake, seed=None):
        self._fake = fake
        if isinstance(seed, _BitGenerator):
            seed = seed.seed
        self._rng = numpy.random.default_rng(seed)

    def random(self, size=None, dtype=numpy.float64, out=None):
        self._fake.launch('random')
        if out is not None:
            if not isinstance(out, DeviceArray):
                raise TypeError('out must be a device array')
            self._rng.random(dtype=dtype, out=out._a)
            return out
        u = self._rng.random(size, dtype=dtype)
        return self._fake._wrap(numpy.asarray(u, dtype=dtype))


class FakeCupy(object):
    """The fake ``cupy`` module; see the module docstring.

    ``n_devices``: how many devices exist (``Device(n)`` fails beyond).
    ``strict_devices``: raise ValueError when an operand lives on another
    device than the current one (CuPy without peer access); off by default.
    """

    ndarray = DeviceArray

    def __init__(self, n_devices=4, strict_devices=False):
        self.__name__ = 'cupy'
        #: True: CuPy's own arithmetic (ufuncs, astype) flushes float32
        #: subnormal operands and results to zero, as CuPy's kernels do
        #: (compiled with -ftz=true); chainer_vgc's kernels never flush
        self.ftz = False
        self.log = []
        #: names of the kernels launched (see the module docstring)
        self.launches = []
        #: CuPy's rules for concatenate and cumsum (the module docstring)
        self.concat_threshold = CONCAT_THRESHOLD
        self.scan_chunk = SCAN_CHUNK
        self.accelerators = ()
        self.n_devices = n_devices
        self.strict_devices = strict_devices
        self._current = 0
        self._pinned = weakref.WeakValueDictionary()
        #: bytes of each ``x.empty_pinned`` / ``x.zeros_pinned`` allocation
        self.pinned_allocations = []
        for name in _DTYPES:
            setattr(self, name, getattr(numpy, name))
        for name in FUNCTIONS + _SEQUENCE_FUNCTIONS:
            setattr(self, name, _Function(self, getattr(numpy, name), name,
                                          allow_host=name.endswith('_like')))
        self.cuda = _Namespace()
        self.cuda.Device = type('Device', (FakeDevice,), {'_fake': self})
        self.cuda.cub = _Namespace(
            CUPY_CUB_CUMSUM=CUPY_CUB_CUMSUM, cub_scan=self._cub_scan)
        self.cuda.runtime = _Namespace()
        self.cuda.runtime.getDevice = lambda: self._current
        self.cuda.runtime.getDeviceCount = lambda: self.n_devices
        self.random = _Namespace()
        self.random.default_rng = lambda seed=None: _Generator(self, seed)
        self.random.Philox4x3210 = _BitGenerator
        self.random.XORWOW = _BitGenerator
        self.x = _Namespace()  # cupyx
        self.x.empty_pinned = self._empty_pinned
        self.x.zeros_pinned = self._zeros_pinned
        self.x.scatter_add = self._scatter_add

    # -- the transfer record -----------------------------------------------
    def _record(self, kind, nbytes, note=''):
        self.log.append((kind, int(nbytes), note))

    def launch(self, name):
        """Record one kernel launch named ``name``."""
        self.launches.append(name)

    def _launch_call(self, name, args, kwargs):
        """Record the launches of CuPy's function ``name`` called with
        ``args`` (see the module docstring)."""
        if name == 'concatenate':
            self._launch_concatenate(args, kwargs)
        elif name == 'cumsum':
            self._launch_cumsum(args, kwargs)
        else:
            self.launch(name)

    def _launch_concatenate(self, args, kwargs):
        arrays = list(args[0] if args else kwargs['arrays'])
        axis = kwargs.get('axis', args[1] if len(args) > 1 else 0)
        out = kwargs.get('out')
        if out is not None:
            dtype = out.dtype
        else:
            dtype = numpy.dtype(kwargs.get('dtype') or numpy.result_type(
                *[a.dtype for a in arrays]))
        nbytes = sum(a.size for a in arrays) * dtype.itemsize
        if (len(arrays) > CONCAT_MIN_INPUTS
                and all(a.dtype == dtype for a in arrays)
                and nbytes < self.concat_threshold * len(arrays)):
            self._record('upload', 8 * len(arrays), 'concatenate pointers')
            if axis is None:
                axis = 0
            share = all(a.flags.c_contiguous and a.shape[axis] ==
                        arrays[0].shape[axis] for a in arrays)
            if not share:
                self._record('upload', 8 * len(arrays),
                             'concatenate offsets')
                self._record('upload', 8 * len(arrays) * arrays[0].ndim,
                             'concatenate strides')
            self.launch('concatenate')
            return
        for a in arrays:
            if a.size:
                self.launch('concatenate.copy')

    def _launch_cumsum(self, args, kwargs):
        a = args[0]
        if kwargs.get('out') is not None:
            self.launch('cumsum.copy')  # result[...] = a
        elif 'cub' in self.accelerators:
            self.launch('cumsum.astype')
        if 'cub' in self.accelerators:
            self.launch('cumsum.cub_init')
            self.launch('cumsum.cub_scan')
            return
        n = a.size
        while n > self.scan_chunk:
            self.launch('cumsum.block_sums')
            self.launch('cumsum.scan')
            n = -(-n // self.scan_chunk)
        if n:
            self.launch('cumsum.scan')

    def _of(self, kind):
        if kind not in KINDS:
            raise ValueError('kind must be one of {}'.format(KINDS))
        return [n for k, n, _ in self.log if k == kind]

    def count(self, kind):
        """How many transfers of ``kind`` (or, for ``'launch'``, kernel
        launches) were recorded."""
        if kind == LAUNCH:
            return len(self.launches)
        return len(self._of(kind))

    def bytes(self, kind):
        """Bytes moved by the transfers of ``kind``."""
        return sum(self._of(kind))

    def reset(self):
        del self.log[:]
        del self.launches[:]

    # -- plumbing ------------------------------------------------------------
    def _check_device(self, arr):
        if self.strict_devices and arr._dev != self._current:
            raise ValueError('array on device {} used while device {} is '
                             'current'.format(arr._dev, self._current))

    def _wrap(self, result, keep=()):
        """Device arrays for NumPy results (0-d for scalars), on the
        current device; an input returned unchanged comes back as its own
        DeviceArray, and a view of an input stays on the input's device."""
        if isinstance(result, (tuple, list)):
            return tuple(self._wrap(r, keep) for r in result)
        for k in keep:
            if result is k._a:
                return k
        if isinstance(result, numpy.ndarray):
            root = _root(result)
            views = [k for k in keep if _root(k._a) is root]
            out = DeviceArray(self, result, views[0]._dev if views else None)
            if views:  # a view of a device array: its owner is the base
                owner = views[0]._owner
                out._owner = views[0] if owner is None else owner
            return out
        if isinstance(result, (numpy.generic, numbers.Number)):
            return DeviceArray(self, numpy.asarray(result))
        return result

    def _call(self, func, args, kwargs, keep=(), first=None):
        keep = keep + tuple(a for a in args if isinstance(a, DeviceArray))
        args = _unwrap(args, self._check_device)
        if first is not None:
            args = (first,) + args
        kwargs = dict(kwargs)
        out = kwargs.get('out')
        if out is not None and not isinstance(out, DeviceArray):
            raise TypeError('out must be a device array')
        kwargs = _unwrap(kwargs, self._check_device)
        result = func(*args, **kwargs)
        return out if out is not None else self._wrap(result, keep)

    # -- transfers -----------------------------------------------------------
    def asarray(self, a, dtype=None, order=None):
        """Device array of ``a``: host data is uploaded (recorded); a
        device array comes back as is (converted if ``dtype`` differs)."""
        if isinstance(a, DeviceArray):
            return a if dtype is None else a.astype(dtype, copy=False)
        if isinstance(a, (list, tuple)) and any(
                isinstance(v, DeviceArray) for v in a):
            raise TypeError('asarray of a list holding device arrays (use '
                            'stack or concatenate)')
        host = numpy.array(a, dtype=dtype, order=order or 'K')
        self._record('upload', host.nbytes, 'asarray')
        return DeviceArray(self, host)

    def array(self, a, dtype=None, copy=True, order='K'):
        """As :meth:`asarray`, but a copy (on the current device) unless
        ``copy=False`` and nothing needs to change."""
        if isinstance(a, DeviceArray):
            if not copy and a._dev == self._current and (
                    dtype is None or a.dtype == numpy.dtype(dtype)):
                return a
            self.launch('array')
            return DeviceArray(self, numpy.array(a._a, dtype=dtype,
                                                 order=order))
        return self.asarray(a, dtype=dtype, order=order)

    def asnumpy(self, a, out=None):
        """Host array of ``a``: a download for a device array (recorded),
        host data passes through."""
        if isinstance(a, DeviceArray):
            return a.get(out=out)
        if out is None:
            return numpy.asarray(a)
        numpy.copyto(out, a)
        return out

    # -- cupy.cuda.cub -------------------------------------------------------
    def _cub_scan(self, a, op):
        if not isinstance(a, DeviceArray):
            raise TypeError('cub_scan needs a device array')
        if op != CUPY_CUB_CUMSUM or a.dtype not in _CUB_DTYPES:
            return None
        if a.size:
            self.launch('cub.init')
            self.launch('cub.scan')
            numpy.cumsum(a._a.reshape(-1), out=a._a.reshape(-1))
        return a

    # -- cupyx ---------------------------------------------------------------
    def _empty_pinned(self, shape, dtype=numpy.float64, order='C'):
        host = numpy.empty(shape, dtype=dtype, order=order)
        self._pinned[id(host)] = host
        self.pinned_allocations.append(host.nbytes)
        return host

    def _zeros_pinned(self, shape, dtype=numpy.float64, order='C'):
        host = self._empty_pinned(shape, dtype, order)
        host.fill(0)
        return host

    def is_pinned(self, arr):
        """Whether host ``arr`` (or an array it views) came from
        ``x.empty_pinned`` / ``x.zeros_pinned``."""
        while isinstance(arr, numpy.ndarray):
            if self._pinned.get(id(arr)) is arr:
                return True
            arr = arr.base
        return False

    def _scatter_add(self, a, slices, value):
        if not isinstance(a, DeviceArray):
            raise TypeError('scatter_add needs a device array')
        self.launch('scatter_add')
        numpy.add.at(a._a, a._index(slices), _unwrap(value,
                                                     self._check_device))


def install(monkeypatch, fake=None):
    """Route ``chainer_vgc.backends.arrays`` to ``fake`` (a new one by default) for
    the test; returns it."""
    from chainer_vgc.backends import arrays
    fake = FakeCupy() if fake is None else fake
    monkeypatch.setattr(arrays, 'cupy', fake)
    monkeypatch.setattr(arrays, 'cupyx', fake.x, raising=False)
    return fake
