"""Per-sample statistics: v += sum_z (grad_z / B)**2 (paper Sec. 4.1, Fig.
"Basic").

The variance term needs, for every parameter element, the sum over the
minibatch of the squared per-example contributions to the minibatch gradient.
:func:`bruteforce_sqsum` computes it exactly for any model by one backward
pass per example (slow: B backward passes; it is the reference and generic
fallback).  The model must not couple examples (no batch normalization in
training mode) and must be deterministic (dropout off or seeded alike).
"""


def bruteforce_sqsum(loss_fn, params, *batch):
    """Exact sum_z (grad_z f / B)**2 by per-example backward passes.

    Args:
        loss_fn: ``loss_fn(*arrays)`` -> scalar Variable, the *mean* loss of
            the examples given.
        params: the :class:`chainer.Parameter` objects to report.
        batch: arrays whose first axis is the batch (B examples).

    Returns:
        list of arrays (None for a parameter that gets no gradient), each the
        parameter's shape, in the parameter's dtype.  Parameter gradients are
        left cleared.
    """
    n = len(batch[0])
    if n == 0:
        raise ValueError('bruteforce_sqsum: empty batch')
    params = list(params)
    acc = [None] * len(params)
    for z in range(n):
        for p in params:
            p.cleargrad()
        loss = loss_fn(*[a[z:z + 1] for a in batch]) / n
        loss.backward()
        for k, p in enumerate(params):
            if p.grad is None:
                continue
            sq = p.grad * p.grad
            acc[k] = sq if acc[k] is None else acc[k] + sq
    for p in params:
        p.cleargrad()
    return acc


def model_params(link):
    """(names, params) of a link in the stable order used everywhere."""
    pairs = sorted(link.namedparams(), key=lambda kv: kv[0])
    return [k for k, _ in pairs], [v for _, v in pairs]
