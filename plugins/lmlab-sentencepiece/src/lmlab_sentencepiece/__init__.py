"""SentencePiece tokenizers for lmlab (entry point ``sentencepiece``)."""
