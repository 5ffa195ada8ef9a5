"""The exchange of one model (paper Alg. 1, Sec. 4.3): its settings
(:mod:`.settings`), its state (:mod:`.state`: rule, residuals, dense group),
one exchange run (:mod:`.run`), the mean of every rank's message
(:mod:`.mean`), the dense fallback (:mod:`.fallback`), snapshots (:mod:`.snapshot`) and
resuming at another rank or world size (:mod:`.elastic`).  What a fault is, and how the workers agree on one,
is :mod:`chainer_vgc.faults`, below both the compressor and this."""
