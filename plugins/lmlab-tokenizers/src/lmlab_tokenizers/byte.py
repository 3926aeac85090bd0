"""Byte-level tokenizer: the UTF-8 bytes of the text, a fixed vocabulary of 256.

Nothing to fit and no unknown input: any text is a byte string (ByT5, Xue et al. 2022,
https://arxiv.org/abs/2105.13626, shows byte models are competitive). A sequence of ids that is
not valid UTF-8 (e.g. a sample cut mid-character) decodes with U+FFFD replacement characters.
"""

from typing import Sequence

import numpy as np

from lmlab.api import Tokenizer
from lmlab_tokenizers.char import as_ids


class ByteTokenizer(Tokenizer):
    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        ids = as_ids(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError(f"byte tokenizer ids must lie in [0, 255], got {ids.min()}..{ids.max()}")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
