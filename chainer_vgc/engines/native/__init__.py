"""The native CPU backend: the library compiled from
``kernels/vgc_host.cpp`` at install (:mod:`.bindings`: loading, the fused
passes, the decode) and its FMT_GAP coder (:mod:`.gap`).  Each rule
registers its fast path over these passes next to the rule
(:mod:`chainer_vgc.backends.registry`); the rules import it, so it
sits between the codec, whose messages it writes, and them."""
