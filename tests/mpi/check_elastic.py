"""Run under mpiexec: snapshots by rank, and resuming at another world size.

    check_elastic.py save OUT METHODS     # train, every rank its own file
    check_elastic.py resume OUT METHODS   # (another world size) resume

``save`` trains each method of the comma-separated METHODS for a few
steps and writes OUT/METHOD/snapshot_rank<r>.npz on every rank (the model and the
optimizer, as a trainer's snapshot holds them), and the
rank's parameters after one more step from there (params_rank<r>.npz).
``resume`` runs at another world size: each rank loads the model and
optimizer from snapshot_rank<r mod the saved size>, with
``resume_residuals=chainer_vgc.ElasticResume(every saved file)``, and
checks

- the default ('own') refuses the snapshot, naming the option, and
  'fresh' loads it with empty residuals and a warning;
- each rank's residuals are the oracle's share, computed here from the
  files with NumPy: r the saved ranks' mean, v its variance (the sum over
  the ranks / p_old**2), in rank order, bit for bit;
- the parameters loaded equal those saved, and training goes on with every
  rank's parameters identical and finite.

Rank 0 prints 'elastic OK: <mode> at p=<size>'.
"""

import glob
import os
import sys
import warnings

import chainer
import chainer.links as L
from mpi4py import MPI
import numpy

import chainer_vgc
from chainer_vgc.harness.models import MLP

from check_state import expect_error

world = MPI.COMM_WORLD
KW = {'vgc': dict(alpha=1.0), 'hybrid': dict(tau=0.001),
      'strom': dict(tau=0.001), 'none': {}}


def data(step, rank, n=16):
    rng = numpy.random.default_rng(1000 * step + rank)
    x = rng.normal(size=(n, 6)).astype(numpy.float32)
    return x, ((x[:, 0] > 0) + (x[:, 1] > 0.5)).astype(numpy.int32)


def setup(method, **kw):
    comm = chainer_vgc.create_communicator(
        method, world, abort_on_exception=False, **dict(KW[method], **kw))
    numpy.random.seed(0)
    model = L.Classifier(MLP((12,), 3))
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.05), comm).setup(model)
    return comm, model, opt


def states(comm, model):
    comp = comm.state(model).compressor
    if comp is None:
        return {}
    return {n: {k: a.copy() for k, a in st.items()}
            for n, st in zip(comp.names, comp.states) if st}


def save(out, method):
    comm, model, opt = setup(method)
    for step in range(6):
        opt.update(model, *data(step, world.rank))
    held = states(comm, model)
    if method != 'none':  # something to carry over
        assert any(a.any() for st in held.values() for a in st.values())
    # as a trainer's snapshot holds them: the model, and the optimizer
    # with the method state under optimizer/vgc_state/
    ser = chainer.serializers.DictionarySerializer()
    ser['model'].save(model)
    ser['optimizer'].save(opt)
    numpy.savez(os.path.join(out, 'snapshot_rank{}.npz'.format(world.rank)),
                **ser.target)
    numpy.savez(os.path.join(out, 'model_rank{}.npz'.format(world.rank)),
                **{n: p.array for n, p in model.namedparams()})


def load(path, model, opt):
    with numpy.load(path) as npz:
        chainer.serializers.NpzDeserializer(npz, path='model/').load(model)
        chainer.serializers.NpzDeserializer(npz, path='optimizer/').load(
            opt)


#: where the method state lies in a snapshot file
STATE = 'optimizer/vgc_state/'


def oracle(out):
    """{name: {key: the share}} from the saved files, with NumPy."""
    files = sorted(glob.glob(os.path.join(out, 'snapshot_rank*.npz')),
                   key=lambda f: int(f.rsplit('rank', 1)[1][:-len('.npz')]))
    p_old = len(files)
    npzs = [numpy.load(f) for f in files]
    shares = {}
    for k in npzs[0].files:
        head, _, key = k.rpartition('/')
        if not head.startswith(STATE) or key not in ('r', 'v'):
            continue
        total = npzs[0][k].copy()
        for z in npzs[1:]:
            total += z[k]
        total /= total.dtype.type(p_old if key == 'r' else p_old * p_old)
        name = '/' + head[len(STATE):]
        shares.setdefault(name, {})[key] = total
    return files, shares


def resume(out, method):
    files, shares = oracle(out)
    p_old = len(files)
    assert p_old != world.size
    mine = files[world.rank % p_old]
    # the default refuses a snapshot of another world size
    _, pmodel, plain = setup(method)
    expect_error(lambda: load(mine, pmodel, plain),
                 'saved by a run of {} ranks'.format(p_old),
                 'this run has {}'.format(world.size), 'ElasticResume')
    # 'fresh': loads, with a warning, and the residuals start empty
    comm, model, opt = setup(method, resume_residuals='fresh')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        load(mine, model, opt)
    assert any('start fresh' in str(w.message) for w in caught), [
        str(w.message) for w in caught]
    comm.setup(model)
    assert all(not a.any() for st in states(comm, model).values()
               for a in st.values())
    # ElasticResume: the share of what every saved rank held
    comm, model, opt = setup(
        method, resume_residuals=chainer_vgc.ElasticResume(files[::-1]))
    load(mine, model, opt)
    saved = numpy.load(os.path.join(out, 'model_rank{}.npz'.format(
        world.rank % p_old)))
    for n, p in model.namedparams():
        assert numpy.array_equal(p.array, saved[n]), n
    comm.setup(model)
    got = states(comm, model)
    assert sorted(got) == sorted(shares), (sorted(got), sorted(shares))
    for name, st in shares.items():
        for key, want in st.items():
            have = got[name][key]
            assert have.dtype == want.dtype and numpy.array_equal(
                have, want), (method, name, key)
    if method != 'none':
        assert shares and any(a.any() for st in shares.values()
                              for a in st.values())
    for step in range(6, 9):
        opt.update(model, *data(step, world.rank))
    params = [p.array.copy() for _, p in sorted(model.namedparams())]
    assert all(numpy.isfinite(a).all() for a in params)
    for a, b in zip(params, world.bcast(params)):
        assert numpy.array_equal(a, b)
    # an incomplete set of saved ranks is refused
    if p_old > 1:
        _, smodel, short = setup(
            method, resume_residuals=chainer_vgc.ElasticResume(files[:-1]))
        expect_error(lambda: load(mine, smodel, short),
                     'every saved rank', str(list(range(p_old - 1))))


def main():
    mode, out, methods = sys.argv[1], sys.argv[2], sys.argv[3].split(',')
    for method in methods:
        where = os.path.join(out, method)
        if mode == 'save':
            if world.rank == 0:
                os.makedirs(where, exist_ok=True)
            world.Barrier()
            save(where, method)
        else:
            resume(where, method)
        world.Barrier()
    if world.rank == 0:
        print('elastic OK: {} at p={}'.format(mode, world.size))


if __name__ == '__main__':
    main()
