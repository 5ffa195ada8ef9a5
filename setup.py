"""Builds the native CPU backend (chainer_vgc/_vgc_native*.so).

The metadata lives in setup.cfg; this file only declares the C++ extension,
compiled from kernels/vgc_host.cpp (one translation unit), which includes
its internal headers kernels/vgc_*.h and kernels/vgc_numerics.cuh (the
source of the CuPy kernels).  The library is loaded with ctypes by
chainer_vgc/engines/native/bindings.py, which compares the source hash compiled in here with
the sources next to it, so a stale build is reported instead of used.
"""

import hashlib
import os
import platform

from setuptools import Extension
from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# every file the library is compiled from, the translation unit first (the
# same names, in the same order, as chainer_vgc/engines/native/bindings.py SOURCES: the hash
# compiled in must equal the one native.py computes)
NATIVE_SOURCES = ('kernels/vgc_host.cpp', 'kernels/vgc_host_common.h',
                  'kernels/vgc_gap_coder.h', 'kernels/vgc_blocks.h',
                  'kernels/vgc_passes.h', 'kernels/vgc_decode.h',
                  'kernels/vgc_numerics.cuh')


def source_hash():
    """sha256 of the native sources (same function as native.source_hash)."""
    h = hashlib.sha256()
    for rel in NATIVE_SOURCES:
        with open(os.path.join(HERE, rel), 'rb') as f:
            h.update(f.read())
    return h.hexdigest()


def native_extension(name, isa_flags):
    return Extension(
        name,
        sources=[NATIVE_SOURCES[0]],
        depends=list(NATIVE_SOURCES[1:]),
        include_dirs=['kernels'],
        define_macros=[('VGC_SOURCE_HASH', '"{}"'.format(source_hash()))],
        # no FMA contraction and no fast-math: results equal the NumPy path;
        # -fno-trapping-math only lets the compiler evaluate both sides of a
        # select (FP exception flags are never read), which vectorizes the
        # per-element functions without changing a value
        extra_compile_args=['-std=c++14', '-O3', '-ffp-contract=off',
                            '-fno-fast-math', '-fno-trapping-math',
                            '-fopenmp'] + isa_flags,
        extra_link_args=['-fopenmp'],
        language='c++',
        # without a C++ compiler the install still succeeds; using the
        # native backend then raises an error that says how to fix it (or
        # select CHAINER_VGC_BACKEND=numpy)
        optional=True,
    )


# The same source twice: for any x86-64 (or other) processor, and with
# AVX2 (no FMA: -ffp-contract=off), picked at run time by native.py when
# the processor has it.
extensions = [native_extension('chainer_vgc._vgc_native', [])]
if platform.machine().lower() in ('x86_64', 'amd64'):
    extensions.append(native_extension('chainer_vgc._vgc_native_avx2',
                                       ['-mavx2', '-mf16c']))


# The start-up hook (chainer_vgc/_startup/_chainer_vgc_compat.py, installed
# as the top-level module _chainer_vgc_compat): a .pth file in site-packages
# runs it when Python starts, so that `import chainer` works on NumPy 2
# whichever module is imported first.  A wheel carries the .pth beside the
# packages (build_py); an editable install (pip install -e) carries it in
# its editable wheel.
COMPAT_PTH = 'chainer_vgc_compat.pth'
COMPAT_PTH_LINE = (
    "import importlib.util as _u; _u.find_spec('_chainer_vgc_compat') "
    "and __import__('_chainer_vgc_compat').install()\n")


def write_compat_pth(directory):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, COMPAT_PTH)
    with open(path, 'w') as f:
        f.write(COMPAT_PTH_LINE)
    return path


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if not getattr(self, 'editable_mode', False):
            write_compat_pth(self.build_lib)

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, 'editable_mode', False):
            return outputs
        return outputs + [os.path.join(self.build_lib, COMPAT_PTH)]


cmdclass = {'build_py': build_py_with_pth}
try:  # setuptools >= 64 (PEP 660 editable installs)
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:
    editable_wheel = None
if editable_wheel is not None and hasattr(editable_wheel,
                                          '_install_namespaces'):
    class editable_wheel_with_pth(editable_wheel):
        # the one step that writes into the editable wheel's root (setuptools
        # 64 to 80): every file there is put into the wheel
        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            write_compat_pth(str(installation_dir))

    cmdclass['editable_wheel'] = editable_wheel_with_pth

setup(ext_modules=extensions, cmdclass=cmdclass)
