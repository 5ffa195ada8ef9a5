"""im2col for the statistics' products: the patches of a convolution's
image side, one column per output position (paper Sec. 4.1: the
per-example weight gradient of a convolution is a product of these
columns and the other side's maps).

On the CPU the columns and the padded image are written into buffers of
the :class:`~chainer_vgc.statistics.contraction.Workspace`, which the next
step reuses (Chainer's own ``im2col_cpu`` makes two new arrays a call:
hundreds of MiB a step for a VGG, which the kernel then pages in again).
The layout is Chainer's: (n, C, kh, kw, out_h, out_w).
"""

import inspect

from chainer.utils import conv as conv_utils
import numpy


def im2col(xp, img, fn, kh, kw, out_h, out_w, work):
    """im2col of ``img`` (n, C, h, w) as (n, C, kh, kw, out_h, out_w) for
    the node ``fn``'s stride, padding and dilation.  On the CPU it is
    written into the workspace's buffers (Chainer's ``im2col_cpu`` pads
    into a new array and returns another); on the GPU Chainer's
    ``im2col_gpu`` (CuPy's pool keeps the memory)."""
    if xp is not numpy:
        return conv_utils.im2col_gpu(
            img, kh, kw, fn.sy, fn.sx, fn.ph, fn.pw, cover_all=bool(
                fn.cover_all), dy=fn.dy, dx=fn.dx, out_h=out_h, out_w=out_w)
    n, c, h, w = img.shape
    sy, sx, ph, pw, dy, dx = fn.sy, fn.sx, fn.ph, fn.pw, fn.dy, fn.dx
    # the padding Chainer's im2col gives: ph + sy - 1 below, pw + sx - 1
    # right (what cover_all may reach)
    pad = work.get(numpy, 'im2col_pad', (n, c, h + 2 * ph + sy - 1,
                                         w + 2 * pw + sx - 1), img.dtype)
    pad[:, :, :ph] = 0
    pad[:, :, ph + h:] = 0
    pad[:, :, ph:ph + h, :pw] = 0
    pad[:, :, ph:ph + h, pw + w:] = 0
    pad[:, :, ph:ph + h, pw:pw + w] = img
    col = work.get(numpy, 'im2col', (n, c, kh, kw, out_h, out_w), img.dtype)
    for j in range(kh):
        y0 = j * dy
        for i in range(kw):
            x0 = i * dx
            col[:, :, j, i] = pad[:, :, y0:y0 + sy * out_h:sy,
                                  x0:x0 + sx * out_w:sx]
    return col


class ColumnCapture(object):
    """The columns Chainer computes for a convolution's own weight
    gradient, kept for that node's statistics instead of computed twice.

    While active (``with``: one :class:`~chainer_vgc.statistics.
    PerSampleSquares` backward pass), ``chainer.utils.conv.im2col_cpu`` and
    ``im2col_gpu`` (Chainer's GPU path without cuDNN) are wrapped so that
    the last columns they made are kept, with the image they
    came from and the call's geometry.  ``Convolution2DGradW`` (the weight
    gradient of Convolution2D, and of Deconvolution2D with the roles of x
    and gy swapped) makes them last in each node's backward, and the hook
    looks at that node right after it: :meth:`take` hands the columns over
    when the image is the very array the node saw and the geometry is the
    same, else None (the statistics then make their own).  One slot only:
    at most one layer's columns are held beyond Chainer's own use.  The
    wrapper is process-wide while active; it is removed on exit.
    """

    def __init__(self):
        self._slot = None
        self._originals = {}
        #: {name: (the function wrapped, its wrapper)}, made once
        self._wrappers = {}

    def __enter__(self):
        self._originals = {}
        for name in ('im2col_cpu', 'im2col_gpu'):
            original = getattr(conv_utils, name)
            wrapper = self._wrappers.get(name)
            if wrapper is None or wrapper[0] is not original:
                wrapper = self._wrappers[name] = (original,
                                                  self._wrap(original))
            self._originals[name] = original
            setattr(conv_utils, name, wrapper[1])
        return self

    def _wrap(self, original):
        """``original`` (im2col_cpu or im2col_gpu, whose signatures differ:
        only the CPU one has ``pval``) with its result kept in the slot."""
        signature = inspect.signature(original)

        def capturing(*args, **kwargs):
            col = original(*args, **kwargs)
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            a = call.arguments
            self._slot = ((a['img'], (a['kh'], a['kw'], a['sy'], a['sx'],
                                      a['ph'], a['pw'], bool(a['cover_all']),
                                      a['dy'], a['dx']), col)
                          if a.get('pval', 0) == 0 else None)
            return col
        capturing.__name__ = original.__name__
        return capturing

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(conv_utils, name, original)
        self._slot, self._originals = None, {}

    def take(self, img, fn, kh, kw):
        """The kept columns of ``img`` for node ``fn``'s geometry, or
        None; the slot is emptied either way."""
        slot, self._slot = self._slot, None
        if slot is None or slot[0] is not img:
            return None
        geometry = (kh, kw, fn.sy, fn.sx, fn.ph, fn.pw, bool(fn.cover_all),
                    fn.dy, fn.dx)
        return slot[2] if slot[1] == geometry else None
