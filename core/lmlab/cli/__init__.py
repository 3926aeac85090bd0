"""The ``lmlab`` command line: one small module per verb, imported only when that verb runs."""
