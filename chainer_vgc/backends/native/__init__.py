"""The native CPU backend: the library compiled from
``kernels/vgc_host.cpp`` at install (:mod:`.bindings`: loading, the fused
passes, the decode), its FMT_GAP coder (:mod:`.gap`) and its fast paths for
the rules that ship (:mod:`.paths`)."""
