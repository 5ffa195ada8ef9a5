"""The device layer, below the codec: where arrays live and which kernels
exist (issue 50).

The array helpers (:mod:`.arrays`: NumPy/CuPy dispatch, pinned host
buffers, the GPU path's buffers of one compressor), the registry of fused
steps by (rule, backend) (:mod:`.registry`) and the CUDA layer
(:mod:`.cuda`: the kernels' specs and source, the CuPy checks).  The
engines that run a whole step with them, and read and write the codec's
messages, sit above the codec: :mod:`chainer_vgc.engines`."""
