"""Stages 2 and 3 of a preparation (see :mod:`lmlab.prepare.pipeline`) and its end: fit the tokenizer
on the spooled training text, tokenise the spool into shards, then write the index and move the entry
into place.

They run once the spool is complete, so they need only the build's checkpointed state and its
folders: functions of the :class:`~lmlab.prepare.stages.Build`, which owns the filter stage's live
state (the held-back document, the open parts, the corpus-level filters)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator

from lmlab import pretrained
from lmlab.api import UserError
from lmlab.prepare import shards, spool
from lmlab.prepare.report import public
from lmlab.prepare.shards import FORMAT, SPLITS
from lmlab.prepare.work import TokenizeTask, Workers


POOL_WORTH_S = 3.0  # tokenising work, in seconds here, that justifies starting worker processes


# -- 2. fit ----------------------------------------------------------------------------------------

def fit(build) -> None:
    build.listener("fit", {})
    tokenizer = build.fitting if build.fitting is not None else build.tokenizer.build()
    saved = build.partial / "tokenizer"
    shards.remove(saved)
    scratch = shards.temporary(build.partial / "scratch")
    scratch.mkdir()
    init_dir = pretrained.tokenizer_dir(build.variant)
    if init_dir is not None:
        # [init]: the init's fitted tokenizer, whose ids its weights were trained with.
        tokenizer.load(init_dir)
    else:
        tokenizer.fit_documents(_documents(build, "train"), scratch)
    building = shards.temporary(saved)
    building.mkdir()
    tokenizer.save(building)
    building.rename(saved)
    shutil.rmtree(scratch, ignore_errors=True)
    st = build.state
    st.update(vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
              dtype=shards.token_dtype(tokenizer.vocab_size).name, tokenizer=shards.files_sha256(saved),
              stage="tokenize")
    build.save_state()


def _documents(build, split: str) -> Iterator[str]:
    """The spooled documents of a split, in order, one at a time."""
    for part in build.state["parts"]:
        if split in part:
            yield from spool.documents(build.spool, shards.shard_name(split, part["index"]))


# -- 3. tokenize -----------------------------------------------------------------------------------

def tokenize(build, pool: Workers) -> None:
    try:
        _tokenize_parts(build, pool)
    except UserError as exc:
        variant = build.variant
        if variant.init is None:
            raise
        data = variant.manifest["data"].get("path") or variant.manifest["data"]["use"]
        raise UserError(f"{data}: holds text that the tokenizer of [init] from = {variant.init.from_} cannot "
                        f"encode ({exc}); a fine-tune keeps the init's vocabulary", key="data") from None


def _tokenize_parts(build, pool: Workers) -> None:
    st = build.state
    done = st["shards"]
    tasks = []
    for part in st["parts"]:
        for split in SPLITS:
            if split not in part:
                continue
            entry = done[split].get(str(part["index"]))
            if entry is not None and shards.verify(build.partial, entry):
                continue
            tasks.append(TokenizeTask(build.spool, build.partial, split, part["index"], build.tokenizer,
                                      build.partial / "tokenizer", st["dtype"], st["separate_documents"],
                                      st["masked"], st.get("weighted", False)))
    total = sum(1 for part in st["parts"] for split in SPLITS if split in part)
    spooled = {(split, part["index"]): part[split]["bytes"] for part in st["parts"] for split in SPLITS
               if split in part}
    progress = {"stage": "tokenize", "total": total, "bytes": 0, "since": time.perf_counter()}

    def finished(entry: dict) -> None:
        split, index = entry["name"].rsplit("-", 1)
        done[split][str(int(index))] = entry
        build.save_state()
        progress["bytes"] += spooled[(split, int(index))]
        progress.update(shards=sum(len(v) for v in done.values()),
                        tokens=sum(e["tokens"] for v in done.values() for e in v.values()))
        build.listener("shard", {"name": entry["name"]})
        build.listener("progress", progress)

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


# -- the index -------------------------------------------------------------------------------------

def finish(build) -> dict:
    """Write the index, keep only what it names, and move the entry into place; returns the index."""
    st = build.state
    listed = {split: [st["shards"][split][str(part["index"])] for part in st["parts"] if split in part]
              for split in SPLITS}
    tokens = {split: sum(entry["tokens"] for entry in listed[split]) for split in SPLITS}
    for split, what in (("train", "training"), ("val", "validation")):
        if tokens[split] == 0:
            raise UserError(f"the {what} split holds no tokens: the corpus is too small", key="data")
    index = {
        "format": FORMAT, "key": build.key, "dtype": st["dtype"], "vocab_size": st["vocab_size"],
        "eos_id": st["eos_id"], "masked": st["masked"], "weighted": st.get("weighted", False),
        "split": st["split"],
        "documents": st["documents"], "tokens": tokens, "input_bytes": st["input_bytes"],
        "source": st["source"], "filters": {s["name"]: public(s) for s in st["filters"]},
        "shards": {split: [entry for entry in listed[split] if entry["tokens"]] for split in SPLITS},
        "tokenizer": st["tokenizer"],  # relative path → SHA-256 of each file of tokenizer/
    }
    shards.write_bytes(build.partial / "index.json", json.dumps(index, indent=1).encode())
    # Only what the index names stays: not the spool, the state, checkpoints of the filters, nor
    # files a killed build left half-written or unreferenced.
    keep = {"index.json", "tokenizer"} | {f"{entry['name']}.{suffix}" for split in SPLITS
                                          for entry in index["shards"][split] for suffix in entry["files"]}
    for path in build.partial.iterdir():
        if path.name not in keep:
            shards.remove(path)
    # What is there is incomplete or damaged (the caller checked, under the builders' lock).
    shards.remove(build.final)
    build.final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(build.partial, build.final)
    build.listener("done", {"index": index, "directory": str(build.final),
                            "seconds": time.perf_counter() - build.started})
    return index
