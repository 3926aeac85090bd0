"""The three stages of a preparation (see :mod:`lmlab.prepare.pipeline`), resumable from its
checkpoints: filter and spool, fit the tokenizer, tokenise into shards; then the index."""

import itertools
import json
import os
import pickle
import shutil
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator

from lmlab import pretrained
from lmlab.api import Record, UserError
from lmlab.prepare import shards, spool
from lmlab.prepare.report import merged, new_stats, public, record
from lmlab.prepare.work import PluginSpec, TokenizeTask, Workers

FORMAT = 2  # bump when the cache layout changes
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
                 listener: Listener, pool: Workers | None = None):
        self.variant, self.key, self.final, self.partial = variant, key, final, partial
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
        # Corpus-level filters admit in this process; the instances are checkpointed with the state.
        self.admitting = {j: spec.build() for j, spec in enumerate(self.filters) if spec.cls.corpus_level}
        self.pending = None  # the last kept document, held back until we know whether it is the last
        self.parts = {split: spool.Part() for split in SPLITS}
        self.started = time.perf_counter()

    # -- the whole build ---------------------------------------------------------------------------

    def run(self) -> None:
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
            self._finish()
        except UserError:
            shutil.rmtree(self.partial, ignore_errors=True)  # nothing a later run could resume from
            raise

    def _resume_or_start(self) -> None:
        path = self.partial / "state.json"
        if path.is_file():
            state = json.loads(path.read_text())
            if state.get("format") == FORMAT and state.get("key") == self.key and self._spool_intact(state):
                self.state = state
                self.shard_bytes = state["shard_bytes"]
                if state["stage"] == "filter" and state.get("blob"):
                    with open(self.partial / state["blob"], "rb") as f:
                        saved = pickle.load(f)
                    self.admitting, self.pending = saved["admitting"], saved["pending"]
                self.listener("resume", {"stage": state["stage"], "parts": len(state["parts"]),
                                         "shards": sum(len(v) for v in state["shards"].values())})
                return
        shutil.rmtree(self.partial, ignore_errors=True)
        self.spool.mkdir(parents=True)
        self.state = {
            "format": FORMAT, "key": self.key, "shard_bytes": self.shard_bytes, "stage": "filter",
            "consumed": 0, "input_bytes": 0, "kept": 0, "documents": {s: 0 for s in SPLITS},
            "masked": False, "parts": [], "blob": None, "shards": {s: {} for s in SPLITS},
            "filters": [new_stats(spec.name) for spec in self.filters],
        }
        self._save_state()

    def _spool_intact(self, state: dict) -> bool:
        for part in state.get("parts", []):
            for split in SPLITS:
                if split in part and not shards.verify(self.spool, {"name": shards.shard_name(split, part["index"]),
                                                                     "files": part[split]["files"]}):
                    return False
        blob = state.get("blob")
        return state.get("stage") != "filter" or not blob or (self.partial / blob).is_file()

    def _save_state(self) -> None:
        tmp = self.partial / ".state.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.partial / "state.json")

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
        size, segments, is_text, trace, signatures = outcome
        st = self.state
        st["consumed"] += 1
        st["input_bytes"] += size
        kept = segments is not None
        for j, (n_in, n_out, changed, counts, dropped) in enumerate(trace):
            if j in signatures:
                admitting = self.admitting[j]
                if not admitting.admit(signatures[j]):
                    dropped, n_out = True, 0
                counts = merged(counts, admitting.__dict__.pop("_counts", None))
            record(st["filters"][j], n_in, n_out, changed, counts, dropped)
            if dropped:
                kept = False
                break
        if kept:
            previous, self.pending = self.pending, (segments, is_text)
            if previous is not None:
                self._assign(previous)

    def _assign(self, doc, split: str | None = None, close: bool = True) -> None:
        st = self.state
        k = st["kept"]
        if split is None:
            split = "val" if (k + 1) * self.p // self.q > k * self.p // self.q else "train"
        st["kept"] += 1
        st["documents"][split] += 1
        segments, _ = doc
        if any(not scored for _, scored in segments):
            st["masked"] = True
        self.parts[split].add(segments)
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
        old, st["blob"] = st["blob"], None
        if st["stage"] == "filter":
            st["blob"] = f"filters-{len(st['parts']):05d}.pkl"
            tmp = self.partial / f".{st['blob']}.tmp"
            with open(tmp, "wb") as f:
                pickle.dump({"admitting": self.admitting, "pending": self.pending}, f, pickle.HIGHEST_PROTOCOL)
            tmp.replace(self.partial / st["blob"])
        self._save_state()
        if old and old != st["blob"]:
            (self.partial / old).unlink(missing_ok=True)

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
                segments, is_text = last
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
                    self._assign((((piece.encode("utf-8"), True),), True), split, close=False)
            else:
                st["split"], st["separate_documents"] = "documents", True
                self._assign(last, "val" if st["documents"]["val"] == 0 else None, close=False)
            self._close_part()
        st["source"] = self.source.stats()
        st["stage"] = "fit"
        self._checkpoint()

    # -- 2. fit ------------------------------------------------------------------------------------

    def _fit(self) -> None:
        self.listener("fit", {})
        tokenizer = self.tokenizer.build()
        scratch, saved = self.partial / "scratch", self.partial / "tokenizer"
        for folder in (scratch, saved):
            shutil.rmtree(folder, ignore_errors=True)
        scratch.mkdir()
        init_dir = pretrained.tokenizer_dir(self.variant)
        if init_dir is not None:
            # [init]: the init's fitted tokenizer, whose ids its weights were trained with.
            tokenizer.load(init_dir)
        else:
            tokenizer.fit_documents(self._documents("train"), scratch)
        building = self.partial / ".tokenizer.tmp"
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir()
        tokenizer.save(building)
        building.rename(saved)
        shutil.rmtree(scratch, ignore_errors=True)
        st = self.state
        st.update(vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                  dtype=shards.token_dtype(tokenizer.vocab_size).name, stage="tokenize")
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
            init = self.variant.manifest.get("init")
            if not init:
                raise
            data = self.variant.manifest["data"].get("path") or self.variant.manifest["data"]["use"]
            raise UserError(f"{data}: holds text that the tokenizer of [init] from = {init['from']} cannot "
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
                                          st["masked"]))
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
            "eos_id": st["eos_id"], "masked": st["masked"], "split": st["split"],
            "documents": st["documents"], "tokens": tokens, "input_bytes": st["input_bytes"],
            "source": st["source"], "filters": {s["name"]: public(s) for s in st["filters"]},
            "shards": {split: [entry for entry in listed[split] if entry["tokens"]] for split in SPLITS},
        }
        (self.partial / "index.json").write_text(json.dumps(index, indent=1))
        # Only what the index names stays: not the spool, the state, checkpoints of the filters, nor
        # files a killed build left half-written or unreferenced.
        keep = {"index.json", "tokenizer"} | {f"{entry['name']}.{suffix}" for split in SPLITS
                                              for entry in index["shards"][split] for suffix in entry["files"]}
        for path in self.partial.iterdir():
            if path.name not in keep:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        if self.final.exists():  # a folder without index.json: never complete, never used
            shutil.rmtree(self.final)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.partial, self.final)
        self.listener("done", {"index": index, "directory": str(self.final), "seconds": time.perf_counter() - self.started})
