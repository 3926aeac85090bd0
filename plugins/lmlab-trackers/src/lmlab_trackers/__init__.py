"""Tracker-slot plugins for lmlab that need no third-party service."""
