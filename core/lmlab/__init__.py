"""lmlab: a plugin-based workbench for language-model experiments."""

__version__ = "0.1.0"
