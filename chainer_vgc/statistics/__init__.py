"""Per-sample statistics: s = sum_z (grad_z / B)**2 (paper Sec. 4.1, Fig.
"Basic"; Sec. 5: "common deep learning libraries do not support access to
gradients of each sample").

:class:`PerSampleSquares` computes, during an ordinary backward pass, for
every parameter the sum over the minibatch of the squared per-example
contributions to the minibatch gradient; :func:`bruteforce_sqsum` computes
the same by one backward pass per example (the reference).  One concept a
module:

* :mod:`~chainer_vgc.statistics.hook`: how the sums are gathered during one
  backward pass (:class:`PerSampleSquares`, what to do with uncovered
  parameters, shared parameters);
* :mod:`~chainer_vgc.statistics.handlers`: each covered Chainer function's
  per-example contributions (Linear, Convolution2D, Deconvolution2D,
  the normalizations, EmbedID), in one table keyed by function class;
* :mod:`~chainer_vgc.statistics.broadcasts`: a parameter combined with
  minibatch data element by element (a scale, a bias, a positional
  embedding, PReLU);
* :mod:`~chainer_vgc.statistics.pullback`: a parameter's contributions
  carried back through the functions between it and its use (a mask, a
  cast, an index, a broadcast, an elementwise function);
* :mod:`~chainer_vgc.statistics.uses`: one use of a parameter, and the
  readable definition of its sum of squares;
* :mod:`~chainer_vgc.statistics.contraction`: the fast exact sums for
  weights whose contributions are products (Gram or blocked per-example,
  a workspace reused from step to step), with
  :mod:`~chainer_vgc.statistics.im2col` for convolutions;
* :mod:`~chainer_vgc.statistics.graph`: which function nodes consume each
  parameter (through the stacks of recurrent layers' weights);
* :mod:`~chainer_vgc.statistics.rows`: which example owns each row a
  function sees (arrays of examples, or one array per example), with
  :mod:`~chainer_vgc.statistics.tracing` tracing the rows of
  variable-length sequences through the graph;
* :mod:`~chainer_vgc.statistics.bruteforce`: the per-example passes, and
  when they are exact (loss scaling, noise, batch normalization).

:func:`model_params` (:mod:`chainer_vgc.params`), the parameter order used
everywhere, is re-exported here.
"""

from chainer_vgc.params import model_params  # NOQA
from chainer_vgc.statistics.bruteforce import bruteforce_sqsum  # NOQA
from chainer_vgc.statistics.hook import DEFAULT_MAX_MEMORY  # NOQA
from chainer_vgc.statistics.hook import PerSampleSquares  # NOQA
from chainer_vgc.statistics.hook import UncoveredParameterError  # NOQA

__all__ = ['DEFAULT_MAX_MEMORY', 'PerSampleSquares',
           'UncoveredParameterError', 'bruteforce_sqsum', 'model_params']
