"""The GPU path: the CuPy kernels built from ``kernels/vgc_numerics.cuh``
(:mod:`.kernels`), the CuPy and NVRTC checks (:mod:`.support`), a whole
model compressed in a fixed number of launches (:mod:`.compress`) and
decoded into its mean with one upload (:mod:`.decode`)."""
