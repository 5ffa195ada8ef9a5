"""The engines: a whole step of every tensor, on one backend, above the
codec whose messages they write and read (issue 50).

* :mod:`.native`: the native CPU backend, the library compiled from
  ``kernels/vgc_host.cpp`` at install (the fused passes each rule
  registers as its fast path, the decode) and its FMT_GAP coder;
* :mod:`.cuda`: the GPU path, a whole model compressed in a fixed number
  of launches (:mod:`.cuda.compress`) and decoded into its mean with one
  upload (:mod:`.cuda.decode`).

Both build from one CUDA source, ``kernels/vgc_numerics.cuh``, through
:mod:`chainer_vgc.backends`, and equal the NumPy reference bit for bit."""
