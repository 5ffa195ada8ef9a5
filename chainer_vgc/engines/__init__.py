"""The engines: a compressor's steps on one backend, both directions
(compress, and every rank's messages to the mean), each with the buffers
it keeps from step to step, above the codec whose messages they write and
read (issue 50).

* :mod:`.reference`: the readable step, in the rule's own NumPy (or
  CuPy) code and the codec's decoder, that every engine equals bit for
  bit and falls back to;
* :mod:`.native`: the native CPU engine (:mod:`.native.engine`) over the
  library compiled from ``kernels/vgc_host.cpp`` at install (the fused
  passes each rule registers as its fast path, the decode) and its FMT_GAP
  coder;
* :mod:`.cuda`: the GPU engine (:mod:`.cuda.engine`), a whole model
  compressed in a fixed number of launches (:mod:`.cuda.compress`) and
  decoded into its mean with one upload (:mod:`.cuda.decode`).

A :class:`~chainer_vgc.compressor.GradientCompressor` picks its NumPy
engine once, from its ``backend``, and makes its GPU engine on the first
CuPy array; the exchange asks it which engine takes an array
(:meth:`~chainer_vgc.compressor.GradientCompressor.engine_for`).  The
native and GPU paths build from one CUDA source,
``kernels/vgc_numerics.cuh``, through :mod:`chainer_vgc.backends`."""
