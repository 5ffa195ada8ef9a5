"""Builds the native CPU backend (chainer_vgc/_vgc_native*.so).

The metadata lives in setup.cfg; this file only declares the C++ extension,
compiled from kernels/vgc_host.cpp, which includes kernels/vgc_numerics.cuh
(the source of the CuPy kernels).  The library is loaded with ctypes by
chainer_vgc/native.py, which compares the source hash compiled in here with
the sources next to it, so a stale build is reported instead of used.
"""

import hashlib
import os
import platform

from setuptools import Extension
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE_SOURCES = ('kernels/vgc_host.cpp', 'kernels/vgc_numerics.cuh')


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
        sources=['kernels/vgc_host.cpp'],
        depends=['kernels/vgc_numerics.cuh'],
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

setup(ext_modules=extensions)
