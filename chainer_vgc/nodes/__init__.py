"""The nodes: a job on nodes of k ranks, each node one VGC worker (issue
27): the communicator (:mod:`.communicator`), which rank owns which
parameter (:mod:`.layout`), one hierarchical exchange (:mod:`.run`) and the
dense transfers inside a node (:mod:`.transfer`)."""
