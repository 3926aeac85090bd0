"""No PEFT: ``none``.

Trains the whole model, exactly as a manifest without a ``[peft]`` table does; it exists so that a
sweep can put full fine-tuning beside the PEFT methods (``"peft.use" = ["none", "lora"]``).
"""

from lmlab.api import Peft


class NoPeft(Peft):
    """``none``: every parameter trains; checkpoints hold the whole model."""

    api = ">=1.4,<2"
