"""``lmlab compress``: a trained run made smaller or faster by the ``compress`` slot's methods, written
as a new run folder that ``generate``, ``eval``, ``serve`` and ``[init]`` load like any other.

:mod:`~lmlab.compress.methods` resolves the methods named on the command line, :mod:`~lmlab.compress.calibration`
draws the windows they measure on, :mod:`~lmlab.compress.measure` scores a model (validation loss on the
run's own split, bytes, generation speed), :mod:`~lmlab.compress.folder` writes the new run folder and
:mod:`~lmlab.compress.restore` gives a freshly built model the compressed structure when it is loaded.
"""
