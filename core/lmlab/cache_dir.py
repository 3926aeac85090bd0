"""Where lmlab keeps what it can make again: prepared token shards, converted checkpoints."""

import os
from pathlib import Path

from lmlab.errors import UserError


def cache_root() -> Path:
    """``$LMLAB_CACHE``, else ``~/.cache/lmlab``."""
    if os.environ.get("LMLAB_CACHE"):
        return Path(os.environ["LMLAB_CACHE"])
    try:
        return Path.home() / ".cache" / "lmlab"
    except RuntimeError:  # no HOME and no user database entry
        raise UserError("there is no home folder for lmlab's cache; set the LMLAB_CACHE environment "
                        "variable to a writable folder") from None
