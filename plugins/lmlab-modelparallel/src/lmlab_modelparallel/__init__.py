"""Model-parallel plugins for lmlab: ``tensor`` and ``pipeline``. Loaded through entry points, never by import."""
