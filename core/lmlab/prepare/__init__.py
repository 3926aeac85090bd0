"""``lmlab prepare``: the corpus filtered, split and tokenised once into sharded memory-mapped token
files, in parallel, resumable and cached. :mod:`lmlab.prepare.pipeline` explains the technique and is
the entry point; :mod:`~lmlab.prepare.stages` runs a build and its filter stage,
:mod:`~lmlab.prepare.tokenizing` its fit and tokenize stages and the index, :mod:`~lmlab.prepare.work`
the worker processes' tasks; :mod:`~lmlab.prepare.spool` and :mod:`~lmlab.prepare.shards` hold the on-disk
formats, :mod:`~lmlab.prepare.checkpoint` what a build resumes from (never a pickle),
:mod:`~lmlab.prepare.entry` the verification of a finished entry before use, and
:mod:`~lmlab.prepare.report` the statistics and the progress line."""
