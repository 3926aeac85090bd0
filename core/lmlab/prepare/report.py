"""What a preparation reports: each filter's statistics, and the progress line on stderr."""

import sys
import time

from lmlab.api import Table


def new_stats(name: str) -> dict:
    return {"name": name, "documents_in": 0, "documents_kept": 0, "documents_dropped": 0, "documents_changed": 0,
            "characters_in": 0, "characters_kept": 0, "characters_dropped": 0, "weight_sum": 0.0,
            "characters_weighted": 0.0, "counts": {}, "tables": []}


def record(stats: dict, n_in: int, n_out: int, changed: bool, counts: dict | None, dropped: bool,
           weight: float = 1.0) -> None:
    """Add one document's passage through a filter; ``weight``: what the filter weighed a kept one."""
    stats["documents_in"] += 1
    stats["characters_in"] += n_in
    if dropped:
        stats["documents_dropped"] += 1
        stats["characters_dropped"] += n_in
    else:
        stats["documents_kept"] += 1
        stats["characters_kept"] += n_out
        stats["weight_sum"] += weight
        stats["characters_weighted"] += weight * n_out
        stats["documents_changed"] += bool(changed)
    for what, n in (counts or {}).items():
        stats["counts"][what] = stats["counts"].get(what, 0) + n


def merged(a: dict | None, b: dict | None) -> dict | None:
    if not b:
        return a
    out = dict(a or {})
    for what, n in b.items():
        out[what] = out.get(what, 0) + n
    return out


def public(stats: dict) -> dict:
    """A filter's statistics as the index and summary.json report them: with its mean weight over the
    documents it kept and the characters they weigh (what training effectively draws from)."""
    out = {k: v for k, v in stats.items() if k not in ("name", "weight_sum")}
    out["mean_weight"] = stats.get("weight_sum", 0.0) / stats["documents_kept"] if stats["documents_kept"] else 0.0
    return out


class Progress:
    """The progress line on stderr: rewritten in place on a terminal, a line every 30 s otherwise."""

    def __init__(self, stream=None, every: float | None = None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every if every is not None else (0.5 if self.tty else 30.0)
        self.last = time.perf_counter()
        self.open = False  # a progress line waits for its newline

    def __call__(self, event: str, info: dict) -> None:
        if event == "progress":
            now = time.perf_counter()
            if now - self.last < self.every:
                return
            self.last = now
            rate = info["bytes"] / 2**20 / max(now - info["since"], 1e-9)
            if info["stage"] == "filter":
                line = f"prepare: reading and filtering: {info['documents']:,} documents, " \
                       f"{info['bytes'] / 2**20:,.1f} MB, {rate:,.1f} MB/s"
            else:
                line = f"prepare: tokenising: {info['shards']}/{info['total']} shards, {info['tokens']:,} tokens, " \
                       f"{rate:,.1f} MB/s"
            self._line(line, transient=True)
        elif event == "resume":
            self._line(f"prepare: resuming an interrupted preparation ({info['parts']} text parts and "
                       f"{info['shards']} token shards kept)")
        elif event == "executor":
            dashboard = f", dashboard {info['dashboard']}" if info.get("dashboard") else ""
            self._line(f"prepare: on the Dask cluster at {info['scheduler']} ({info['workers']} worker(s){dashboard})")
        elif event == "note":
            self._line(f"prepare: {info['text']}")
        elif event == "lost":
            self._line(f"prepare: {info['why']}; resuming from the last checkpoint on the remaining workers")
        elif event == "wait":
            self._line("prepare: waiting for another process that prepares the same data")
        elif event == "fit":
            self._line("prepare: fitting the tokenizer on the training split", transient=True)
        elif event == "done":
            index, seconds = info["index"], info["seconds"]
            mb = index["input_bytes"] / 2**20
            n_shards = sum(len(v) for v in index["shards"].values())
            self._line(f"prepare: {index['documents']['train']:,} + {index['documents']['val']:,} documents → "
                       f"{index['tokens']['train']:,} train + {index['tokens']['val']:,} val tokens in {n_shards} "
                       f"shard(s), {mb:,.1f} MB in {seconds:.1f} s ({mb / max(seconds, 1e-9):,.1f} MB/s)")
            for name, s in index["filters"].items():
                self._line(f"  {name}: kept {s['documents_kept']:,} of {s['documents_in']:,} documents "
                           f"({s['documents_changed']:,} changed), {s['characters_kept']:,} of "
                           f"{s['characters_in']:,} characters"
                           + (f", mean weight {s['mean_weight']:.3f} ({s['characters_weighted']:,.0f} characters "
                              "weighted)" if s.get("mean_weight", 1.0) < 1.0 else "")
                           + "".join(f", {k} {v:,}" for k, v in s["counts"].items()))
                for table in s.get("tables", ()):
                    for text in Table.from_dict(table).lines():
                        self._line("    " + text)
            for what, n in index["source"].items():
                self._line(f"  data: {what} {n:,}")

    def _line(self, text: str, transient: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + ("" if transient else "\n"))
            self.open = transient
        elif not transient or text.startswith("prepare: reading") or text.startswith("prepare: tokenising"):
            self.stream.write(text + "\n")
        self.stream.flush()
