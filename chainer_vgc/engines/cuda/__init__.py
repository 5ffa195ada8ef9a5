"""The GPU engine (:mod:`.engine`): a whole model compressed in a fixed
number of launches (:mod:`.compress`, a rule adding its select pass) and
decoded into its mean with one upload (:mod:`.decode`), over
:mod:`chainer_vgc.backends.cuda`'s kernels."""
