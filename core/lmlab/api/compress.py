"""The compress slot (API 1.9): methods that make a trained model smaller or faster, run by
``lmlab compress RUN_DIR --use METHOD``, one after another in the order named (prune, then quantise).

A method changes the model in place (:meth:`Compressor.compress`) and returns a record, plain JSON,
of what it did. The new run folder's checkpoint holds the compressed state dict and every method's
record; loading that run (``generate``, ``eval``, ``serve``, ``[init]``) builds the model from the
manifest as usual, asks each method to :meth:`Compressor.restructure` it from its record (the same
module types and shapes, with placeholder values), then loads the state dict. So a compressed
weight must be held in plain tensors (parameters or buffers: int8, uint8, float), never in a tensor
subclass or a pickled object, which ``weights_only`` loading would refuse.
"""

from dataclasses import dataclass
from typing import ClassVar, Iterator

import torch
import torch.nn.functional as F

from lmlab.api.plugin import Plugin


@dataclass
class Calibration:
    """Token windows a method measures the model on (API 1.9): by default the run's own validation
    split, or ``lmlab compress --calibration FILE`` encoded by the run's tokenizer.

    ``windows`` is (N, T + 1) int64 on the model's device: inputs ``[:, :-1]``, next tokens ``[:, 1:]``.
    """

    windows: torch.Tensor
    batch_size: int = 8

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets), each (B, T), ``batch_size`` windows at a time."""
        for start in range(0, len(self.windows), self.batch_size):
            chunk = self.windows[start:start + self.batch_size]
            yield chunk[:, :-1], chunk[:, 1:]

    @torch.no_grad()
    def run(self, model) -> None:
        """Run the model on every batch without gradients: forward hooks the method registered on its
        modules see every activation (AWQ's and Wanda's input statistics)."""
        for inputs, _ in self.batches():
            model(inputs)

    def losses(self, model) -> Iterator[torch.Tensor]:
        """The mean next-token cross-entropy of each batch, with gradients enabled (a method calls
        ``backward`` on each: gradient importance)."""
        with torch.enable_grad():
            for inputs, targets in self.batches():
                logits = model(inputs)
                yield F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @property
    def tokens(self) -> int:
        """How many tokens the windows predict (N × T)."""
        return int(self.windows[:, 1:].numel())


class Compressor(Plugin):
    """A compression method: the base class of the ``compress`` slot (API 1.9).

    The core calls :meth:`compress` once on the trained model in eval mode (float32, on the CPU
    unless a device was asked for), with the methods named before it already applied; later, in
    any process that loads the compressed run, :meth:`restructure` on a freshly built model.
    """

    slot: ClassVar[str] = "compress"
    calibrated: ClassVar[bool] = False
    """The method measures the model on calibration data (AWQ, Wanda, gradient head importance): the
    core refuses to run it when there is none, and otherwise passes a :class:`Calibration`."""

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise ``UserError`` naming ``compress.<name>.<option>`` for a setting this model cannot take
        (more heads than it has, a group size that does not divide a layer). The core calls it for
        every method of a chain on the uncompressed model, before anything is measured or written, so
        that bad input costs no calibration. Default: nothing."""

    def compress(self, model: torch.nn.Module, calibration: Calibration | None) -> dict:
        """Compress ``model`` in place; return the record :meth:`restructure` needs (plain JSON: the
        names of the replaced modules, the heads kept, ...) plus any figures worth a line in the
        summary (``summary`` key: a dict of numbers, e.g. the sparsity reached).

        Raise ``UserError`` naming ``compress.<name>.<option>`` for a setting this model cannot take
        (more heads than it has), before changing anything.
        """
        raise NotImplementedError

    def restructure(self, model: torch.nn.Module, record: dict) -> None:
        """Give a freshly built model of the run the structure :meth:`compress` left (replace the same
        modules with the same types and shapes, shrink the same projections), so that the compressed
        state dict loads into it strictly. Default: nothing (a method that only changes values, such
        as unstructured pruning)."""
