"""Which parameters, in which order: the one parameter order every part of
chainer-vgc uses (the statistics, the communicator's messages, the
simulation, the examples), so that every worker lists a model's parameters
identically without exchanging names.
"""


def model_params(link):
    """(names, params) of a link, sorted by name: the order used everywhere
    (the same on every worker)."""
    pairs = sorted(link.namedparams(), key=lambda kv: kv[0])
    return [k for k, _ in pairs], [v for _, v in pairs]
