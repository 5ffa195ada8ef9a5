"""The exchange of one model (paper Alg. 1, Sec. 4.3): its settings
(:mod:`.settings`), its state (:mod:`.state`: rule, residuals, dense group),
one exchange run (:mod:`.run`), the mean of every rank's message
(:mod:`.mean`), the dense fallback (:mod:`.fallback`), the agreement on
faults (:mod:`.faults`) and snapshots (:mod:`.snapshot`)."""
