"""The backends: where a step runs (issue 37).

The array helpers (:mod:`.arrays`: NumPy/CuPy dispatch, pinned host
buffers), the registry of fused steps by (rule, backend) (:mod:`.registry`),
the native CPU backend (:mod:`.native`) and the GPU path (:mod:`.cuda`).
Both compiled backends build from one CUDA source,
``kernels/vgc_numerics.cuh``, and equal the NumPy reference bit for bit."""
