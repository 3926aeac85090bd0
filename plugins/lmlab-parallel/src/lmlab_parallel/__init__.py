"""Parallel-slot plugins for lmlab: how a run is laid out over devices and nodes."""
