"""Throughput of `lmlab prepare` with 1 and 2 worker processes, on the Python standard library.

The corpus is this interpreter's own standard library (every ``*.py`` under ``sysconfig``'s stdlib,
site-packages left out: about 30 MB of real code, with real near-duplicates such as the
``encodings/cp*.py`` code pages), found at run time. Two configurations:

- ``filters``: the five filters (quality with thresholds for code, pii-scrub, timestamp-mask,
  exact-dedup, minhash-dedup) and the byte tokenizer: what a cleaning pass costs;
- ``plain``: no filters and the char tokenizer: reading, fitting and tokenising only.

Runs alternate between worker counts (1, 2, 1, 2, ...), each into a fresh cache, and the script checks
that both counts write byte-identical shards. MB/s is the corpus's UTF-8 size over the wall time of
the whole preparation (fingerprint, filtering, fitting, tokenising, index), pool start-up included,
taking each count's fastest run (other processes on a shared machine only ever slow a run down;
the median is printed too).

    python bench/prepare_speed.py [--repeats 2] [--config filters|plain|both]
"""

import argparse
import hashlib
import json
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from lmlab import manifest
from lmlab.prepare import pipeline

STDLIB = Path(sysconfig.get_paths()["stdlib"])

CONFIGS = {
    "filters": ('[tokenizer]\nuse = "byte"\n\n'
                '[filter]\nuse = ["quality", "pii-scrub", "timestamp-mask", "exact-dedup", "minhash-dedup"]\n\n'
                '[filter.quality]\nmin_words = 20\nmax_mean_word_length = 0\nmin_alpha_word_fraction = 0.3\n'
                'max_symbol_word_ratio = 0.5\nmax_duplicate_line_fraction = 0.6\nmax_duplicate_line_char_fraction = 0.6\n'),
    "plain": '[tokenizer]\nuse = "char"\nunknown = "skip"\n',
}


def write_manifest(folder: Path, config: str) -> Path:
    path = folder / f"stdlib-{config}.toml"
    path.write_text(f'name = "stdlib"\n\n[data]\nuse = "text-file"\npath = "{STDLIB}/**/*.py"\n'
                    f'exclude = ["*/site-packages/*"]\nbad_file = "skip"\n\n{CONFIGS[config]}\n'
                    '[tracker]\nuse = "none"\n')
    return path


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def quiet(event: str, info: dict) -> None:
    pass


def measure(variant, scratch: Path, **options) -> tuple[float, dict, str]:
    """(seconds, index, digest of the shards) of one preparation into a fresh cache under ``scratch``;
    ``options`` go to ``prepare_corpus`` (``workers``, ``executor``)."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    start = time.perf_counter()
    folder = pipeline.prepare_corpus(variant, root=root, listener=quiet, **options)
    seconds = time.perf_counter() - start
    return seconds, json.loads((folder / "index.json").read_text()), digest(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", choices=[*CONFIGS, "both"], default="both")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} | CPUs: {pipeline.default_workers()}")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for config in (CONFIGS if args.config == "both" else [args.config]):
            (variant,) = manifest.load(write_manifest(scratch, config))
            times: dict[int, list[float]] = {1: [], 2: []}
            digests, index = set(), None
            for _ in range(args.repeats):
                for workers in (1, 2):
                    seconds, index, h = measure(variant, scratch, workers=workers)
                    times[workers].append(seconds)
                    digests.add(h)
            mb = index["input_bytes"] / 2**20
            rate = {w: mb / min(t) for w, t in times.items()}
            median = {w: mb / statistics.median(t) for w, t in times.items()}
            kept = sum(index["documents"].values())
            print(f"\n[{config}] {mb:.1f} MB, {kept:,} documents kept, "
                  f"{sum(index['tokens'].values()):,} tokens; runs (s): "
                  + ", ".join(f"{w} worker(s) {[round(t, 1) for t in ts]}" for w, ts in times.items()))
            for name, s in index["filters"].items():
                print(f"  {name}: dropped {s['documents_dropped']:,} of {s['documents_in']:,} {s['counts']}")
            print(f"  1 worker  {rate[1]:6.2f} MB/s (median {median[1]:.2f})")
            print(f"  2 workers {rate[2]:6.2f} MB/s (median {median[2]:.2f})")
            print(f"  ratio 2 / 1 workers = {rate[2] / rate[1]:.2f} (medians {median[2] / median[1]:.2f}; target >= 1.6); "
                  f"shards identical across worker counts: {len(digests) == 1}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
