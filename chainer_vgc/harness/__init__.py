"""The paper harness: p workers in one process without MPI
(:mod:`.simulation`), the models of the experiments (:mod:`.models`, App. D)
and the offline data (:mod:`.datasets`)."""
