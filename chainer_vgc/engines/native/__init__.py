"""The native CPU engine (:mod:`.engine`) over the library compiled from
``kernels/vgc_host.cpp`` at install (:mod:`.bindings`: loading, the fused
passes, the decode) and its FMT_GAP coder (:mod:`.gap`).  Each rule
registers its fast path over these passes next to the rule
(:mod:`chainer_vgc.backends.registry`), so the rules import
:mod:`.bindings`; the engine imports no rule."""
