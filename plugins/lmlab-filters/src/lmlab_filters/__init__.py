"""Data-hygiene filters for lmlab (entry points ``exact-dedup``, ``minhash-dedup``, ``quality``, ``pii-scrub``,
``timestamp-mask``, ``code-sanitize``), applied by ``lmlab prepare`` in manifest order."""
