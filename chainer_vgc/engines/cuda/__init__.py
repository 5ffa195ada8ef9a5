"""The GPU engine: a whole model compressed in a fixed number of launches
(:mod:`.compress`) and decoded into its mean with one upload
(:mod:`.decode`), over :mod:`chainer_vgc.backends.cuda`'s kernels."""
