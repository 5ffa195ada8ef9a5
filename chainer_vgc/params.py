"""Which parameters, in which order: the one parameter order every part of
chainer-vgc uses (the statistics, the communicator's messages, the
simulation, the examples), so that every worker lists a model's parameters
identically without exchanging names; which of them a dense mean takes
(:func:`with_gradients`); and how an error or a warning names several of
them (:func:`some_of`).
"""

#: how many names an error or a warning lists before '... and N more'
SHOWN = 3


def model_params(link):
    """(names, params) of a link, sorted by name: the order used everywhere
    (the same on every worker)."""
    pairs = sorted(link.namedparams(), key=lambda kv: kv[0])
    return [k for k, _ in pairs], [v for _, v in pairs]


def with_gradients(params, zero_fill):
    """The ``params`` (in the order given: model_params', the same on
    every worker) that take part in a dense mean: those with a gradient,
    and with ``zero_fill`` (ChainerMN's) also the initialized ones
    without, whose gradient becomes zeros first."""
    out = []
    for param in params:
        if zero_fill and param.grad is None:
            if param.array is None:
                continue
            param.grad = param.xp.zeros_like(param.array)
        if param.grad is not None:
            out.append(param)
    return out


def some_of(names, shown=SHOWN):
    """``names`` for a message: all of them up to ``shown``, else the first
    ``shown`` and how many more ('/a, /b, /c and 93 more'), so that an
    error about a large model stays readable."""
    names = [str(n) for n in names]
    if len(names) <= shown:
        return ', '.join(names)
    return '{} and {} more'.format(', '.join(names[:shown]),
                                   len(names) - shown)
