"""A preparation (see :mod:`lmlab.prepare.pipeline`), resumable from its checkpoints: the build's
state and stage 1, filter and spool. Stages 2 and 3 (fit the tokenizer, tokenise into shards) and the
index are in :mod:`lmlab.prepare.tokenizing`."""

import itertools
import json
import shutil
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator

from lmlab.api import Conversation, Record, Table, UserError
from lmlab.conversation import ConversationWriter, conversation_writer
from lmlab.errors import warn
from lmlab.prepare import checkpoint, shards, spool, staging, tokenizing
from lmlab.prepare.report import merged, new_stats, record
from lmlab.prepare.shards import FORMAT, SPLITS, remove
from lmlab.prepare.work import PluginSpec, WorkerLost, Workers, checked_weight

CHUNK_CHARS = 1 << 18  # documents per filtering task: about this many characters...
CHUNK_DOCS = 256  # ...or this many documents
READ_BYTES = 1 << 20  # source per part that a Dask worker reads (at most a spool part's: the pipeline stays fine-grained)
LOST_WORKERS = 3  # Dask workers with part of an index that a preparation survives (resuming each time)

Listener = Callable[[str, dict], None]


def filter_specs(variant) -> list[PluginSpec]:
    """The variant's filters in manifest order, as worker processes rebuild them."""
    return [PluginSpec(cls, cls.name, variant.options("filter", cls.name)) for cls in variant.plugins.get("filter", [])]


class Build:
    """One preparation of one cache entry, from its partial folder to the finished one."""

    def __init__(self, variant, source, key: str, final: Path, partial: Path, workers: int, shard_bytes: int,
                 listener: Listener, pool: Workers | None = None, tokenizer=None):
        self.variant, self.key, self.final, self.partial = variant, key, final, partial
        self.fitting = tokenizer  # the instance the fit stage fits (the caller's), or None: a new one
        self.spool = partial / "text"
        self.workers, self.listener = workers, listener
        self.source = source  # the data source whose fingerprint is in the key
        self.filters = filter_specs(variant)
        self.pool = pool  # a pool started earlier by the caller, or None
        tok_cls = variant.plugins["tokenizer"]
        self.tokenizer = PluginSpec(tok_cls, tok_cls.name, variant.options("tokenizer"))
        self.val_fraction = variant.options("data").val_fraction
        fraction = Fraction(self.val_fraction).limit_denominator(10**6)
        self.p, self.q = fraction.numerator, fraction.denominator
        self.shard_bytes = shard_bytes
        self.state: dict = {}
        # Corpus-level filters admit in this process; their state_dict is checkpointed with the state.
        self.admitting = self._corpus_filters()
        self.pending = None  # the last kept document, held back until we know whether it is the last
        self.parts = {split: spool.Part() for split in SPLITS}
        self.reading = None  # the Dask workers' reading of the source (lmlab.prepare.staging), if they read it
        self.pool_in_use = None
        self.started = time.perf_counter()
        self._conversations: ConversationWriter | None = None

    def conversations(self) -> ConversationWriter:
        """How the source's Conversations are written out: with its template, else the tokenizer's."""
        if self._conversations is None:
            from lmlab import pretrained

            tokenizer = self.fitting if self.fitting is not None else self.tokenizer.build()
            init = pretrained.tokenizer_dir(self.variant)
            if init is not None and tokenizer is not self.fitting:
                tokenizer.load(init)
            self._conversations = conversation_writer(self.source, tokenizer)
        return self._conversations

    def _corpus_filters(self) -> dict:
        decide = getattr(self.pool, "admitting", lambda j, f, partial: f)  # a Dask pool may partition an index
        return {j: decide(j, spec.build(), self.partial) for j, spec in enumerate(self.filters) if spec.cls.corpus_level}

    # -- the whole build ---------------------------------------------------------------------------

    def run(self) -> dict:
        """Build the entry; returns its index."""
        try:
            with self.pool or Workers(self.workers, self.filters) as pool:
                self.pool_in_use = pool
                if self.filters and not (self.partial / "tokenizer").is_dir():  # filtering to do
                    # Workers take a second to start (they import their plugins): let them start
                    # while this process checks the partial build and reads documents.
                    pool.start()
                for lost in range(LOST_WORKERS + 1):
                    try:
                        self._stages(pool)
                        break
                    except WorkerLost as exc:
                        if lost == LOST_WORKERS:
                            raise WorkerLost(f"{exc}, {lost + 1} times; run the same command again to resume "
                                             "from the last checkpoint") from None
                        # The lost part of the index is rebuilt from its checkpointed segments by new
                        # shards on the remaining workers, and the build goes on from that checkpoint.
                        self.listener("lost", {"why": str(exc)})
                        self.admitting, self.pending = self._corpus_filters(), None
                        self.parts = {split: spool.Part() for split in SPLITS}
            return tokenizing.finish(self)
        except UserError:
            shutil.rmtree(self.partial, ignore_errors=True)  # nothing a later run could resume from
            raise

    def _stages(self, pool) -> None:
        self._resume_or_start()
        if self.state["stage"] == "filter":
            self._filter(pool)
        if self.state["stage"] == "fit":
            tokenizing.fit(self)
        if self.state["stage"] == "tokenize":
            tokenizing.tokenize(self, pool)

    def _resume_or_start(self) -> None:
        try:
            if self._resume():
                return
        except checkpoint.Unusable as exc:
            warn(f"the interrupted preparation in {self.partial} cannot be resumed ({exc}); starting it over")
            self.admitting, self.pending = self._corpus_filters(), None  # may hold part of a bad state
        remove(self.partial)
        self.spool.mkdir(parents=True)
        self.state = {
            "format": FORMAT, "key": self.key, "shard_bytes": self.shard_bytes, "stage": "filter",
            "consumed": 0, "input_bytes": 0, "kept": 0, "documents": {s: 0 for s in SPLITS},
            "masked": False, "weighted": False, "parts": [], "checkpoint": None, "shards": {s: {} for s in SPLITS},
            "filters": [new_stats(spec.name) for spec in self.filters],
        }
        self.save_state()

    def _resume(self) -> bool:
        """Take up the partial build's state when there is one; raises ``checkpoint.Unusable``."""
        if self.partial.is_symlink() or not self.partial.is_dir():
            return False
        state = checkpoint.read_state(self.partial / "state.json", FORMAT, self.key,
                                      [spec.name for spec in self.filters], SPLITS)
        if state is None:
            return False
        for part in state["parts"]:
            for split in SPLITS:
                name = shards.shard_name(split, part["index"])
                if split in part and not shards.verify(self.spool, {"name": name, "files": part[split]["files"]}):
                    raise checkpoint.Unusable(f"the spooled text {name} does not match its checksums")
        if state["stage"] == "tokenize" and shards.files_sha256(self.partial / "tokenizer") != state["tokenizer"]:
            raise checkpoint.Unusable("the fitted tokenizer's files do not match their checksums")
        if state["stage"] == "filter" and state["checkpoint"]:
            self.pending = checkpoint.load(self.partial, state["checkpoint"], self._named(self.admitting))
        self.state = state
        self.shard_bytes = state["shard_bytes"]
        self.listener("resume", {"stage": state["stage"], "parts": len(state["parts"]),
                                 "shards": sum(len(v) for v in state["shards"].values())})
        return True

    def _named(self, filters: dict) -> dict:
        return {j: (self.filters[j].name, f) for j, f in filters.items()}

    def save_state(self) -> None:
        """Checkpoint the state (every stage does, :mod:`lmlab.prepare.tokenizing`'s too)."""
        shards.write_bytes(self.partial / "state.json", json.dumps(self.state, indent=1).encode())

    # -- 1. filter ---------------------------------------------------------------------------------

    def _filter(self, pool: Workers) -> None:
        st = self.state
        resumed_bytes = st["input_bytes"]
        reading = getattr(pool, "reading", None)  # a Dask cluster's workers read the source themselves
        remove(self.partial / "stage")
        self.reading = reading and reading(self.source, self.partial / "stage", st["consumed"],
                                           min(READ_BYTES, self.shard_bytes), self.conversations())
        if self.reading is not None:
            outcomes = self.reading
        else:
            documents = itertools.islice(self.source.documents(), st["consumed"], None)
            # Without filters a task is only UTF-8 encoding: cheaper here than a round trip to a worker.
            outcomes = pool.map("filter_chunk", self._chunks(documents), parallel=bool(self.filters))
        for chunk in outcomes:
            for outcome in chunk:
                self._fold(outcome)
            self.listener("progress", {"stage": "filter", "documents": st["consumed"],
                                       "bytes": st["input_bytes"] - resumed_bytes, "since": self.started})
        self._end_of_stream()

    def _chunks(self, documents) -> Iterator[list]:
        chunk, size = [], 0
        for number, doc in enumerate(documents, self.state["consumed"] + 1):
            if isinstance(doc, Conversation):
                doc = self.conversations().record(doc, f"{self.source.name} document {number}")
            elif not isinstance(doc, (str, Record)):
                raise TypeError(f"data plugin {self.source.name!r} yielded a {type(doc).__name__}; documents "
                                "are str, lmlab.api.Record or lmlab.api.Conversation")
            chunk.append(doc)
            size += len(doc) if isinstance(doc, str) else sum(len(s.text) for s in doc.segments)
            if size >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    def _fold(self, outcome: tuple) -> None:
        """One document's outcome, in corpus order: the corpus-level filters' verdicts, the filters'
        statistics, and the document itself into a split."""
        size, segments, is_text, trace, signatures, weight = outcome
        st = self.state
        st["consumed"] += 1
        st["input_bytes"] += size
        kept = segments is not None
        for j, (n_in, n_out, changed, counts, dropped, own) in enumerate(trace):
            if j in signatures:
                admitting = self.admitting[j]
                verdict = admitting.admit(signatures[j])
                if verdict is False or verdict is None:
                    dropped, n_out = True, 0
                elif verdict is not True:  # a weight (API 1.11)
                    own = checked_weight(verdict, f"filter {admitting.name!r}: admit")
                    weight *= own
                counts = merged(counts, admitting.__dict__.pop("_counts", None))
            record(st["filters"][j], n_in, n_out, changed, counts, dropped, own)
            if dropped:
                kept = False
                break
        if kept:
            previous, self.pending = self.pending, (segments, is_text, weight)
            if previous is not None:
                self._assign(previous)

    def _assign(self, doc, split: str | None = None, close: bool = True) -> None:
        st = self.state
        k = st["kept"]
        if split is None:
            split = "val" if (k + 1) * self.p // self.q > k * self.p // self.q else "train"
        st["kept"] += 1
        st["documents"][split] += 1
        segments, _, weight = doc
        if any(not scored for _, scored in segments):
            st["masked"] = True
        if weight != 1.0:
            st["weighted"] = True
        self.parts[split].add(segments, weight)
        if close and sum(part.size for part in self.parts.values()) >= self.shard_bytes:
            self._close_part()

    def _close_part(self) -> None:
        st = self.state
        index = len(st["parts"])
        entry = {"index": index}
        for split, part in self.parts.items():
            if part.documents:
                name = shards.shard_name(split, index)
                if self.reading is not None:  # its text is staged on the workers' side
                    entry[split] = self.pool_in_use.write_part(part, self.spool, name, self.reading.stage)
                else:
                    entry[split] = part.write(self.spool, name)
        self.parts = {split: spool.Part() for split in SPLITS}
        st["parts"].append(entry)
        self._checkpoint()
        if self.reading is not None:
            # Every document before the part being folded is spooled, but the one held back.
            held = [data.file for data, _ in (self.pending[0] if self.pending else ())
                    if isinstance(data, staging.Staged)]
            staging.prune(self.reading.stage, min([self.reading.current, *held]))
        self.listener("part", {"index": index, "documents": st["consumed"]})

    def _checkpoint(self) -> None:
        st = self.state
        old, st["checkpoint"] = st["checkpoint"], None
        if st["stage"] == "filter":
            pending = self.pending
            if self.reading is not None:  # the checkpoint holds its text, which the workers staged
                pending = staging.resolved(pending, self.reading.stage)
            name = f"filters-{len(st['parts']):05d}.npz"
            st["checkpoint"] = checkpoint.save(self.partial, name, self._named(self.admitting), pending)
            if st["checkpoint"] is None:
                # A corpus-level filter without a state_dict: state.json stays as it was before the
                # first document, so an interrupted build filters again from the start.
                return
        self.save_state()
        if old and (st["checkpoint"] is None or old["file"] != st["checkpoint"]["file"]):
            (self.partial / old["file"]).unlink(missing_ok=True)

    def _end_of_stream(self) -> None:
        st = self.state
        if self.pending is None and st["kept"] == 0:
            if st["consumed"] == 0:
                raise UserError("the corpus is empty: the data source yielded no documents", key="data")
            dropped = ", ".join(f"{s['name']} dropped {s['documents_dropped']:,}" for s in st["filters"])
            raise UserError(f"the filters dropped all {st['consumed']:,} documents ({dropped})", key="filter.use")
        if self.pending is not None:  # else a resumed build that had got this far: all assigned
            last, self.pending = self.pending, None
            if self.reading is not None and st["kept"] == 0:
                last = staging.resolved(last, self.reading.stage)
            # No part closes until the last document is in: a checkpoint in between would hold a
            # half-assigned end of the corpus.
            if st["kept"] == 0:  # one document: cut it by characters
                segments, is_text, weight = last
                if not is_text:
                    raise UserError("the corpus holds one record, which cannot be split into training and "
                                    "validation data; it needs at least two", key="data")
                text = segments[0][0].decode("utf-8")
                cut = int(len(text) * (1 - self.val_fraction))
                if cut == 0 or cut == len(text):
                    raise UserError(f"the corpus is one document of {len(text)} character"
                                    f"{'s' if len(text) != 1 else ''}, too short to hold "
                                    f"out {self.val_fraction} of it for validation", key="data.val_fraction")
                _check_window_fits(self.variant, len(text[:cut].encode("utf-8")), len(text[cut:].encode("utf-8")))
                st["split"], st["separate_documents"] = "characters", False
                for piece, split in ((text[:cut], "train"), (text[cut:], "val")):
                    self._assign((((piece.encode("utf-8"), 1),), True, weight), split, close=False)
            else:
                st["split"], st["separate_documents"] = "documents", True
                self._assign(last, "val" if st["documents"]["val"] == 0 else None, close=False)
            self._close_part()
        st["source"] = self.reading.stats if self.reading is not None else self.source.stats()
        for j, instance in self.admitting.items():
            st["filters"][j]["tables"] = _tables(instance, self.filters[j].name)
        st["stage"] = "fit"
        self._checkpoint()
        if self.reading is not None:
            remove(self.reading.stage)
            self.reading = None


def _check_window_fits(variant, train_bytes: int, val_bytes: int) -> None:
    """A corpus too short for one window of the run is refused before the tokenizer is fitted on it:
    fitted on a few characters, it would otherwise fail first on one the validation part holds alone,
    and blame the tokenizer. No tokenizer makes more tokens than bytes, but for a document's
    specials (two allowed), so this refuses only what the run's own check would (lmlab.train.module)."""
    chosen = variant.slots.get("objective")
    if chosen is not None and chosen.build().sampling != "windows":
        return
    block_size = variant.model.block_size
    path = getattr(variant.options("data"), "path", None)
    corpus = f"the corpus ({path})" if path is not None else "the corpus"
    for split, held, needs in (("train", train_bytes, block_size + 2), ("val", val_bytes, block_size + 1)):
        if held + 2 < needs:
            raise UserError(f"{corpus} is too short: its {split} split holds {held:,} bytes, fewer than a window "
                            f"of block_size + 1 = {block_size + 1} tokens needs; use more data or a smaller "
                            "model.block_size", key="model.block_size")


def _tables(instance, name: str) -> list[dict]:
    """A corpus-level filter's report (API 1.12), as JSON for the state and the index."""
    report = instance.report()
    if not isinstance(report, (list, tuple)) or not all(isinstance(t, Table) for t in report):
        raise TypeError(f"filter {name!r}: report() returned {report!r}; it returns a list of lmlab.api.Table")
    return [t.as_dict() for t in report]
