"""Fast paths: a backend's fused step for a rule, registered by the rule.

The question this module answers: which compiled step, if any, replaces a
rule's readable :meth:`~chainer_vgc.rules.CompressionRule.compress` on a
backend?  A rule is the method (paper Alg. 1 and its variants): state,
hyperparameters and ``compress``, in plain NumPy/CuPy.  A backend that can
do a rule's step faster, for the wire format the rule's settings choose,
registers a factory here; the compressor asks :func:`find` and falls back
to the rule's own ``compress`` when nothing is registered.  A fast path
must give the same message and state as the rule, bit for bit (the tests
compare them).

One dispatch for every backend: each shipped rule's module registers its
paths next to the rule (``chainer_vgc/rules/vgc.py`` ...): for
``'native'`` a factory of a :data:`FastPath` over the native backend's
fused pass (:mod:`chainer_vgc.engines.native.bindings`), for ``'cuda'``
a factory of a :data:`DeviceRule`, the rule's part of the GPU engine's
whole-model step (:mod:`chainer_vgc.engines.cuda.compress`: its state
keys, its select pass, its values).  A rule of your own registers its own
the same way (``register('native', MyRule, factory)``,
``docs/contributing.md``).  Nothing in this module names a rule, so it
sits in the device layer, below the codec and the rules.
"""

import collections

#: A backend's step for one rule object.
#:
#: - ``compress(workspace, tensor_id, grad, sqsum, state, new_state, out)``
#:   reads ``state``, writes the next state into ``new_state`` (same keys)
#:   and the group into ``out`` (a uint32 array of at least ``max_words``
#:   words), returning ``(words, elements, flags)``
#:   (:mod:`chainer_vgc.engines.native.bindings`);
#: - ``max_words(size, dtype)``: the most words a group of a tensor of
#:   ``size`` elements of ``dtype`` can take (header included);
#: - ``checks_inputs``: whether ``compress`` checks its inputs (finite
#:   gradient, finite non-negative sums of squares) itself; False: the
#:   compressor checks them before any tensor is compressed (a rule with
#:   state outside its state arrays, like a random generator, needs this to
#:   leave everything untouched on a bad gradient).
FastPath = collections.namedtuple('FastPath',
                                  'compress max_words checks_inputs')

#: A rule's part of the GPU engine's whole-model compress step
#: (:mod:`chainer_vgc.engines.cuda.compress`), which runs the rest (the
#: gathers, the scan, the layout, the message's words, the download):
#:
#: - ``keys``: the rule's state arrays, each an arena over the whole
#:   model (``('r', 'v')``; ``()``: none);
#: - ``select(rule, p)``: launches the rule's select pass over the whole
#:   model, ``p`` a :class:`~chainer_vgc.engines.cuda.compress.SelectPass`:
#:   it reads the gradients ``p.g`` (and ``p.sqsums()``, gathered on its
#:   first call) and the state ``p.old[key]``, writes the next state into
#:   ``p.new[key]``, each element's sign into ``p.sign`` (int8, 0 where
#:   not selected), 1 into ``p.ok`` (int64) where the element is sent, the
#:   fault flags into ``p.flags`` (a word a tensor) and, quantized,
#:   each tensor's largest selected ``|r|`` into ``p.maxbits``;
#: - ``quantized``: the values are VGC's e_k-quantized ones (Sec. 4.2:
#:   the layout finds e_k, the write pass resets the sent elements' r
#:   and v); else every sent element carries its sign times ``scale``;
#: - ``scale(rule)``: that value (e.g. Strom's tau, read each step; None
#:   when quantized);
#: - ``dense``: no selection, every element sent as a dense FMT_RAW group
#:   (method 'none'; ``select`` is not called).
DeviceRule = collections.namedtuple('DeviceRule',
                                    'keys select quantized scale dense')

#: (backend, rule class) -> factory(rule) -> FastPath or None
_FACTORIES = {}


def register(backend, rule_class, factory):
    """Register ``factory(rule) -> FastPath or None`` (``'cuda'``: a
    :data:`DeviceRule`; None: no fast path for that rule's settings) as
    ``backend``'s step for ``rule_class`` and its subclasses (a subclass's
    own registration wins)."""
    _FACTORIES[(backend, rule_class)] = factory


def find(backend, rule):
    """The fast path ``backend`` registered for ``rule``'s class,
    or for the nearest base class whose ``compress`` the rule still uses
    (a subclass that overrides ``compress`` runs its own); None without
    one."""
    for cls in type(rule).__mro__:
        factory = _FACTORIES.get((backend, cls))
        if factory is not None:
            if type(rule).compress is not cls.compress:
                return None
            return factory(rule)
    return None
