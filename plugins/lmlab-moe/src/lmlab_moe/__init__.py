"""Mixture-of-experts feed-forward plugin for lmlab: moe. Loaded through entry points, never by import."""
