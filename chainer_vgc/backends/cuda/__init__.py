"""The CUDA layer: the CuPy kernels built from
``kernels/vgc_numerics.cuh`` (:mod:`.kernels`) and the CuPy and NVRTC
checks (:mod:`.support`).  The GPU engine over them is
:mod:`chainer_vgc.engines.cuda`."""
