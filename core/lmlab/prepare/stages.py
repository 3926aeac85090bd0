"""The three stages of a preparation (see :mod:`lmlab.prepare.pipeline`), resumable from its
checkpoints: filter and spool, fit the tokenizer, tokenise into shards; then the index."""

import itertools
import json
import os
import shutil
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator

from lmlab import pretrained
from lmlab.api import Record, Table, UserError
from lmlab.errors import warn
from lmlab.prepare import checkpoint, shards, spool
from lmlab.prepare.report import merged, new_stats, public, record
from lmlab.prepare.work import PluginSpec, TokenizeTask, Workers, checked_weight

FORMAT = 3  # bump when the cache layout changes
CHUNK_CHARS = 1 << 18  # documents per filtering task: about this many characters...
CHUNK_DOCS = 256  # ...or this many documents
POOL_WORTH_S = 3.0  # tokenising work, in seconds here, that justifies starting worker processes
SPLITS = ("train", "val")

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
        self.val_fraction = variant.manifest["data"]["val_fraction"]
        fraction = Fraction(self.val_fraction).limit_denominator(10**6)
        self.p, self.q = fraction.numerator, fraction.denominator
        self.shard_bytes = shard_bytes
        self.state: dict = {}
        # Corpus-level filters admit in this process; their state_dict is checkpointed with the state.
        self.admitting = self._corpus_filters()
        self.pending = None  # the last kept document, held back until we know whether it is the last
        self.parts = {split: spool.Part() for split in SPLITS}
        self.started = time.perf_counter()

    def _corpus_filters(self) -> dict:
        decide = getattr(self.pool, "admitting", lambda j, f, partial: f)  # a Dask pool may partition an index
        return {j: decide(j, spec.build(), self.partial) for j, spec in enumerate(self.filters) if spec.cls.corpus_level}

    # -- the whole build ---------------------------------------------------------------------------

    def run(self) -> dict:
        """Build the entry; returns its index."""
        try:
            with self.pool or Workers(self.workers, self.filters) as pool:
                if self.filters and not (self.partial / "tokenizer").is_dir():  # filtering to do
                    # Workers take a second to start (they import their plugins): let them start
                    # while this process checks the partial build and reads documents.
                    pool.start()
                self._resume_or_start()
                if self.state["stage"] == "filter":
                    self._filter(pool)
                if self.state["stage"] == "fit":
                    self._fit()
                if self.state["stage"] == "tokenize":
                    self._tokenize(pool)
            return self._finish()
        except UserError:
            shutil.rmtree(self.partial, ignore_errors=True)  # nothing a later run could resume from
            raise

    def _resume_or_start(self) -> None:
        try:
            if self._resume():
                return
        except checkpoint.Unusable as exc:
            warn(f"the interrupted preparation in {self.partial} cannot be resumed ({exc}); starting it over")
            self.admitting, self.pending = self._corpus_filters(), None  # may hold part of a bad state
        _remove(self.partial)
        self.spool.mkdir(parents=True)
        self.state = {
            "format": FORMAT, "key": self.key, "shard_bytes": self.shard_bytes, "stage": "filter",
            "consumed": 0, "input_bytes": 0, "kept": 0, "documents": {s: 0 for s in SPLITS},
            "masked": False, "weighted": False, "parts": [], "checkpoint": None, "shards": {s: {} for s in SPLITS},
            "filters": [new_stats(spec.name) for spec in self.filters],
        }
        self._save_state()

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

    def _save_state(self) -> None:
        shards.write_bytes(self.partial / "state.json", json.dumps(self.state, indent=1).encode())

    # -- 1. filter ---------------------------------------------------------------------------------

    def _filter(self, pool: Workers) -> None:
        st = self.state
        resumed_bytes = st["input_bytes"]
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
        for doc in documents:
            if not isinstance(doc, (str, Record)):
                raise TypeError(f"data plugin {self.source.name!r} yielded a {type(doc).__name__}; documents "
                                "are str or lmlab.api.Record")
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
                entry[split] = part.write(self.spool, shards.shard_name(split, index))
        self.parts = {split: spool.Part() for split in SPLITS}
        st["parts"].append(entry)
        self._checkpoint()
        self.listener("part", {"index": index, "documents": st["consumed"]})

    def _checkpoint(self) -> None:
        st = self.state
        old, st["checkpoint"] = st["checkpoint"], None
        if st["stage"] == "filter":
            name = f"filters-{len(st['parts']):05d}.npz"
            st["checkpoint"] = checkpoint.save(self.partial, name, self._named(self.admitting), self.pending)
            if st["checkpoint"] is None:
                # A corpus-level filter without a state_dict: state.json stays as it was before the
                # first document, so an interrupted build filters again from the start.
                return
        self._save_state()
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
                st["split"], st["separate_documents"] = "characters", False
                for piece, split in ((text[:cut], "train"), (text[cut:], "val")):
                    self._assign((((piece.encode("utf-8"), 1),), True, weight), split, close=False)
            else:
                st["split"], st["separate_documents"] = "documents", True
                self._assign(last, "val" if st["documents"]["val"] == 0 else None, close=False)
            self._close_part()
        st["source"] = self.source.stats()
        for j, instance in self.admitting.items():
            st["filters"][j]["tables"] = _tables(instance, self.filters[j].name)
        st["stage"] = "fit"
        self._checkpoint()

    # -- 2. fit ------------------------------------------------------------------------------------

    def _fit(self) -> None:
        self.listener("fit", {})
        tokenizer = self.fitting if self.fitting is not None else self.tokenizer.build()
        saved = self.partial / "tokenizer"
        _remove(saved)
        scratch = shards.temporary(self.partial / "scratch")
        scratch.mkdir()
        init_dir = pretrained.tokenizer_dir(self.variant)
        if init_dir is not None:
            # [init]: the init's fitted tokenizer, whose ids its weights were trained with.
            tokenizer.load(init_dir)
        else:
            tokenizer.fit_documents(self._documents("train"), scratch)
        building = shards.temporary(saved)
        building.mkdir()
        tokenizer.save(building)
        building.rename(saved)
        shutil.rmtree(scratch, ignore_errors=True)
        st = self.state
        st.update(vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                  dtype=shards.token_dtype(tokenizer.vocab_size).name, tokenizer=shards.files_sha256(saved),
                  stage="tokenize")
        self._save_state()

    def _documents(self, split: str) -> Iterator[str]:
        """The spooled documents of a split, in order, one at a time."""
        for part in self.state["parts"]:
            if split in part:
                yield from spool.documents(self.spool, shards.shard_name(split, part["index"]))

    # -- 3. tokenize -------------------------------------------------------------------------------

    def _tokenize(self, pool: Workers) -> None:
        try:
            self._tokenize_parts(pool)
        except UserError as exc:
            if self.variant.init is None:
                raise
            data = self.variant.manifest["data"].get("path") or self.variant.manifest["data"]["use"]
            raise UserError(f"{data}: holds text that the tokenizer of [init] from = {self.variant.init.from_} cannot "
                            f"encode ({exc}); a fine-tune keeps the init's vocabulary", key="data") from None

    def _tokenize_parts(self, pool: Workers) -> None:
        st = self.state
        done = st["shards"]
        tasks = []
        for part in st["parts"]:
            for split in SPLITS:
                if split not in part:
                    continue
                entry = done[split].get(str(part["index"]))
                if entry is not None and shards.verify(self.partial, entry):
                    continue
                tasks.append(TokenizeTask(self.spool, self.partial, split, part["index"], self.tokenizer,
                                          self.partial / "tokenizer", st["dtype"], st["separate_documents"],
                                          st["masked"], st.get("weighted", False)))
        total = sum(1 for part in st["parts"] for split in SPLITS if split in part)
        spooled = {(split, part["index"]): part[split]["bytes"] for part in st["parts"] for split in SPLITS
                   if split in part}
        progress = {"stage": "tokenize", "total": total, "bytes": 0, "since": time.perf_counter()}

        def finished(entry: dict) -> None:
            split, index = entry["name"].rsplit("-", 1)
            done[split][str(int(index))] = entry
            self._save_state()
            progress["bytes"] += spooled[(split, int(index))]
            progress.update(shards=sum(len(v) for v in done.values()),
                            tokens=sum(e["tokens"] for v in done.values() for e in v.values()))
            self.listener("shard", {"name": entry["name"]})
            self.listener("progress", progress)

        parallel = pool.executor is not None  # still running from the filters
        if tasks and not parallel:
            # Starting a pool costs a second or two; it pays only when tokenising is slow (subword
            # models), not for bytes or characters: time the first shard here and decide.
            started = time.perf_counter()
            finished(pool.local.tokenize_part(tasks[0]))
            rate = spooled[(tasks[0].split, tasks[0].index)] / max(time.perf_counter() - started, 1e-6)
            tasks = tasks[1:]
            parallel = sum(spooled[(t.split, t.index)] for t in tasks) / rate > POOL_WORTH_S
        for entry in pool.map("tokenize_part", tasks, parallel=parallel):
            finished(entry)

    # -- the index ---------------------------------------------------------------------------------

    def _finish(self) -> None:
        st = self.state
        listed = {split: [st["shards"][split][str(part["index"])] for part in st["parts"] if split in part]
                  for split in SPLITS}
        tokens = {split: sum(entry["tokens"] for entry in listed[split]) for split in SPLITS}
        for split, what in (("train", "training"), ("val", "validation")):
            if tokens[split] == 0:
                raise UserError(f"the {what} split holds no tokens: the corpus is too small", key="data")
        index = {
            "format": FORMAT, "key": self.key, "dtype": st["dtype"], "vocab_size": st["vocab_size"],
            "eos_id": st["eos_id"], "masked": st["masked"], "weighted": st.get("weighted", False),
            "split": st["split"],
            "documents": st["documents"], "tokens": tokens, "input_bytes": st["input_bytes"],
            "source": st["source"], "filters": {s["name"]: public(s) for s in st["filters"]},
            "shards": {split: [entry for entry in listed[split] if entry["tokens"]] for split in SPLITS},
            "tokenizer": st["tokenizer"],  # relative path → SHA-256 of each file of tokenizer/
        }
        shards.write_bytes(self.partial / "index.json", json.dumps(index, indent=1).encode())
        # Only what the index names stays: not the spool, the state, checkpoints of the filters, nor
        # files a killed build left half-written or unreferenced.
        keep = {"index.json", "tokenizer"} | {f"{entry['name']}.{suffix}" for split in SPLITS
                                              for entry in index["shards"][split] for suffix in entry["files"]}
        for path in self.partial.iterdir():
            if path.name not in keep:
                _remove(path)
        # What is there is incomplete or damaged (the caller checked, under the builders' lock).
        _remove(self.final)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.partial, self.final)
        self.listener("done", {"index": index, "directory": str(self.final), "seconds": time.perf_counter() - self.started})
        return index


def _tables(instance, name: str) -> list[dict]:
    """A corpus-level filter's report (API 1.12), as JSON for the state and the index."""
    report = instance.report()
    if not isinstance(report, (list, tuple)) or not all(isinstance(t, Table) for t in report):
        raise TypeError(f"filter {name!r}: report() returned {report!r}; it returns a list of lmlab.api.Table")
    return [t.as_dict() for t in report]


def _remove(path: Path) -> None:
    """Delete a file or folder; a symbolic link itself, never what it points to."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
