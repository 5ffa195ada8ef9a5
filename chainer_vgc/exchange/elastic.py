"""Resuming where the ranks differ: what a snapshot of another rank or of
another world size does to the residuals (``resume_residuals``).

A rank's residuals (Alg. 1's r and v) are the elements of *its* gradients
not sent yet, so a snapshot loads, by default, only on the rank and world
size that saved it (:mod:`chainer_vgc.exchange.snapshot` refuses the
others, naming the per-rank pattern).  ``'fresh'`` starts them empty with
a warning; an :class:`ElasticResume` reads the snapshots of every saved
rank and gives each new rank the rule's share of what they held
(:meth:`chainer_vgc.rules.CompressionRule.share_residuals`).  The records
are checked by :mod:`~chainer_vgc.exchange.snapshot`, which owns the
snapshot's layout.
"""

import json

import numpy

#: what a snapshot of another rank or world size does to the residuals
#: (besides an :class:`ElasticResume`)
RESUME_RESIDUALS = ('own', 'fresh')

#: how per-rank snapshot files are saved, and resumed, for the messages
SAVE_PER_RANK = (
    "Save a snapshot on every rank, each to its own file "
    "(extensions.snapshot(filename='snapshot_rank{}_iter_{{.updater."
    "iteration}}'.format(comm.rank)), or ChainerMN's "
    "chainermn.create_multi_node_checkpointer(name, comm))")
PER_RANK = SAVE_PER_RANK + ', and resume every rank from its own'


class ElasticResume(object):
    """``create_communicator(..., resume_residuals=ElasticResume(paths))``:
    resume at another world size from the snapshots every saved rank wrote
    (``paths``: their ``.npz`` files, one per saved rank, any order).
    Every new rank reads all of them and starts each parameter's state
    from the rule's share of what the saved ranks held
    (:meth:`~chainer_vgc.rules.CompressionRule.share_residuals`: r the
    saved ranks' mean, v its variance), so that the averaged update owes
    the model the same delayed gradient as before.  The run totals are
    those of the snapshot the rank loads (every rank's are the same); the
    rule's own state (QSGD's random stream) starts as this rank's.
    ``prefix``: where the method state lies in the files (the key before
    ``vgc_state/meta``), when a file holds several models' states."""

    def __init__(self, paths, prefix=None):
        if isinstance(paths, str) or not paths:
            raise ValueError(
                'ElasticResume takes the list of the saved ranks\' '
                'snapshot files (one per saved rank), got {!r}'.format(paths))
        self.paths = [str(p) for p in paths]
        self.prefix = prefix

    def __repr__(self):
        return 'ElasticResume({!r})'.format(self.paths)

    def records(self, key_of):
        """``[(meta, {name: {key: array}}, path)]``, one per file;
        ``key_of(name, key)``: where the snapshot keeps a state array,
        under ``vgc_state/``."""
        out = []
        for path in self.paths:
            with numpy.load(path, allow_pickle=False) as npz:
                metas = sorted(k for k in npz.files
                               if k.endswith('vgc_state/meta') and (
                                   self.prefix is None or k.startswith(
                                       self.prefix)))
                if len(metas) != 1:
                    raise ValueError(
                        'chainer_vgc: ElasticResume found {} method states '
                        'in {} ({}); give the one to merge as '
                        "ElasticResume(paths, prefix='...')".format(
                            len(metas), path, metas or 'none'))
                base = metas[0][:-len('meta')]
                meta = json.loads(str(npz[metas[0]]))
                states = {}
                for name in meta['states']:
                    head = base + key_of(name, '')
                    for k in npz.files:
                        if k.startswith(head) and '/' not in k[len(head):]:
                            states.setdefault(name, {})[
                                k[len(head):]] = numpy.array(npz[k])
                out.append((meta, states, path))
        return out


def check_resume_residuals(value):
    """``resume_residuals``: ``'own'`` (default: a snapshot loads only on
    the rank and world size that saved it), ``'fresh'`` or an
    :class:`ElasticResume`."""
    if isinstance(value, ElasticResume) or (
            isinstance(value, str) and value in RESUME_RESIDUALS):
        return value
    raise ValueError(
        "resume_residuals must be 'own' (a snapshot loads on the rank that "
        "saved it), 'fresh' (another rank's or world size's snapshot "
        "starts the residuals empty, with a warning) or "
        "chainer_vgc.ElasticResume([the saved ranks' snapshot files]), got "
        "{!r}".format(value))
