"""Near-duplicate removal with MinHash and locality-sensitive hashing (datasketch).

Two documents are near-duplicates when the Jaccard similarity of their sets of shingles (here: word
n-grams) reaches a threshold. MinHash (Broder 1997, "On the resemblance and containment of
documents") estimates that similarity as the share of agreeing minima of the shingles' hashes under
``num_perm`` random permutations; LSH banding (Indyk & Motwani 1998; Leskovec, Rajaraman & Ullman,
*Mining of Massive Datasets*, ch. 3) finds candidate pairs without comparing all pairs: the signature
is cut into b bands of r rows, and documents that agree on a whole band are candidates, which happens
with probability 1 - (1 - s^r)^b at similarity s; datasketch picks b and r for the threshold. GPT-3
(Brown et al. 2020) and the deduplication study of Lee et al. 2022 removed near-duplicates this way.

What "near" means depends on the shingles: with the default word 5-grams, a document with one
passage of 5 % of its words rewritten has a Jaccard similarity of about 0.9 to the original, while
5 % of its words changed at scattered places breaks a quarter of its 5-grams (similarity about 0.63):
shorter shingles (``ngram = 1`` or ``2``) and a lower threshold catch such edits, at the price of
more unrelated documents looking alike.

Workers compute each document's MinHash (CRC-32 of each distinct shingle, permuted with datasketch's
"affine32" scheme; the permutations are drawn once from ``seed``). The main process then queries the
LSH index in corpus order: a document with an indexed candidate whose estimated similarity reaches
``threshold`` is dropped (the first of a group is kept; banding also proposes some pairs below the
threshold, hence the check), otherwise it is indexed. The index holds every kept document's
signature, ``num_perm`` × 4 bytes each; a checkpoint of the preparation holds those signatures as
one (n, num_perm) uint32 array, and the index is rebuilt from them when it resumes.
"""

import zlib

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH

from lmlab.api import Field, Filter, Options


class MinHashDedupOptions(Options):
    threshold: float = Field(0.8, gt=0, lt=1, help="Jaccard similarity of the shingle sets at or above which a "
                                                   "document is a near-duplicate of an earlier one")
    num_perm: int = Field(128, ge=16, le=1024, help="permutations per MinHash: more estimate the similarity "
                                                    "better and cost proportionally more")
    ngram: int = Field(5, ge=1, help="shingle length in words")
    lowercase: bool = Field(True, help="compare texts ignoring case")
    seed: int = Field(1, ge=0, help="seed of the permutations")


class MinHashDedup(Filter):
    """``minhash-dedup``: drops documents whose shingles overlap an earlier document's by ``threshold``."""

    Options = MinHashDedupOptions
    # lmlab.api.Filter. The state methods of 1.6 are only called by a core that has them; an older one
    # checkpoints the instance as it always did (__getstate__).
    api = ">=1.6,<2"  # Filter.state_dict; Filter (1.3); shuffle_keys, admit_among (1.14) where the core has them
    corpus_level = True

    def __init__(self, options: MinHashDedupOptions | None = None):
        super().__init__(options)
        self._template: MinHash | None = None  # workers: the permutations, drawn once
        # Bands and rows chosen to weigh a missed pair 49× a false candidate: datasketch's default
        # weighs them equally and proposes only ~40 % of the pairs right at the threshold (17 bands
        # of 7 rows for 128 permutations propose 98 %). Every candidate is checked against the
        # estimated similarity, so a false one costs one comparison of two signatures.
        self.lsh = MinHashLSH(threshold=self.options.threshold, num_perm=self.options.num_perm,
                              weights=(0.02, 0.98))
        self.signatures: list[np.ndarray] = []  # main process: (num_perm,) uint32 per indexed document

    def shingles(self, text: str) -> set[bytes]:
        words = (text.lower() if self.options.lowercase else text).split()
        n = self.options.ngram
        return {" ".join(words[i:i + n]).encode("utf-8") for i in range(max(1, len(words) - n + 1))}

    def signature(self, text: str) -> bytes:
        o = self.options
        if self._template is None:
            self._template = MinHash(num_perm=o.num_perm, seed=o.seed, hashfunc=zlib.crc32)
        m = MinHash(num_perm=o.num_perm, seed=o.seed, hashfunc=zlib.crc32,
                    permutations=self._template.permutations, scheme=self._template.scheme)
        m.update_batch(list(self.shingles(text)))
        return m.hashvalues.astype("<u4").tobytes()  # 4 bytes per permutation to the main process

    def admit(self, signature: bytes) -> bool:
        values = np.frombuffer(signature, dtype="<u4")
        minhash = LeanMinHash(seed=self.options.seed, hashvalues=values, scheme="affine32")
        for key in self.lsh.query(minhash):
            if np.mean(self.signatures[key] == values) >= self.options.threshold:
                self.count("near_duplicates")
                return False
        self._index(values, minhash)
        return True

    def shuffle_keys(self, signature: bytes) -> list[bytes]:
        # The LSH bands' keys as datasketch files them (band number, then the band's hashed values):
        # two documents share one exactly when lsh.query would propose one for the other.
        minhash = LeanMinHash(seed=self.options.seed, hashvalues=np.frombuffer(signature, dtype="<u4"),
                              scheme="affine32")
        return [band.to_bytes(2, "little") + bytes(self.lsh._H(minhash.hashvalues[start:end]))
                for band, (start, end) in enumerate(self.lsh.hashranges)]

    def admit_among(self, signature: bytes, candidates: list) -> bool:
        values = np.frombuffer(signature, dtype="<u4")
        for other in candidates:
            if np.mean(np.frombuffer(other, dtype="<u4") == values) >= self.options.threshold:
                self.count("near_duplicates")
                return False
        return True

    def _index(self, values: np.ndarray, minhash: LeanMinHash) -> None:
        self.lsh.insert(len(self.signatures), minhash, check_duplication=False)
        self.signatures.append(values)

    def state_dict(self) -> dict:
        num_perm = self.options.num_perm
        signatures = np.stack(self.signatures) if self.signatures else np.zeros((0, num_perm), "<u4")
        return {"signatures": signatures}  # (n, num_perm) uint32, in the order they were indexed

    def load_state_dict(self, state: dict) -> None:
        signatures = state.get("signatures")
        num_perm = self.options.num_perm
        if not isinstance(signatures, np.ndarray) or signatures.dtype != np.dtype("<u4") \
                or signatures.ndim != 2 or signatures.shape[1] != num_perm:
            raise ValueError(f"minhash-dedup: 'signatures' must be an (n, {num_perm}) uint32 array")
        if self.signatures:
            raise ValueError("minhash-dedup: load_state_dict needs a fresh instance")
        # Inserted in the same order under the same keys: the index, and so every later query,
        # is the one the saving instance had.
        for values in signatures:
            self._index(values, LeanMinHash(seed=self.options.seed, hashvalues=values, scheme="affine32"))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_template"] = None  # rebuilt on demand; only the admitting state needs to persist
        return state
