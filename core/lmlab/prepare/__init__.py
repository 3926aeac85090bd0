"""``lmlab prepare``: the corpus filtered, split and tokenised once into sharded memory-mapped token
files, in parallel, resumable and cached (:mod:`lmlab.prepare.pipeline`; the file format in
:mod:`lmlab.prepare.shards`, the worker processes' tasks in :mod:`lmlab.prepare.work`)."""
