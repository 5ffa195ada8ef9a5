"""The ChainerMN face: the communicator (:mod:`.communicator`) over its
collectives (:mod:`.collectives`) and transport (:mod:`.transport`: the
pipelined ring allgatherv, Sec. 4.3), the multi-node optimizer
(:mod:`.multi_node_optimizer`, :mod:`.double_buffering`) and the MPI library
check (:mod:`.mpi_support`)."""
