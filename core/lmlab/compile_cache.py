"""Where torch.compile keeps what it compiled, so that a second process does not pay for it again.

torch caches compiled graphs (inductor's FX graph cache and AOTAutograd's cache, both on by
default) under ``$TORCHINDUCTOR_CACHE_DIR``, else a folder in the system's temporary directory,
which a reboot or a cluster node's scratch policy empties. lmlab points it into its own cache folder
(``$LMLAB_CACHE/torchinductor``) unless the user chose a folder: the first compile of a model's
training or decode step costs tens of seconds on a CPU, and a later process finds it there.
"""

import os

from lmlab.cache_dir import cache_root

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def use_compile_cache() -> str:
    """The folder torch.compile will cache into (lmlab's, unless ``$TORCHINDUCTOR_CACHE_DIR`` names one)."""
    if not os.environ.get(VARIABLE):
        folder = cache_root() / "torchinductor"
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[VARIABLE] = str(folder)
    return os.environ[VARIABLE]
