"""Generation: the engine decoders drive (rows of different lengths over one key/value cache,
contiguous or paged), each prompt's stopping rules and streamed text, and the loops that run a
decoder for ``lmlab generate``, the closing sample of ``lmlab run`` and ``Decoder.generate``."""
