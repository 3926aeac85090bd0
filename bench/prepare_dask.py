"""`lmlab prepare` on the local executor against a local Dask cluster, both with 2 workers.

The corpus and configurations are ``bench/prepare_speed.py``'s (this Python's standard library,
about 30 MB of code; ``filters``: five filters and the byte tokenizer; ``plain``: the char
tokenizer alone). Runs alternate (local, dask, local, dask, ...), each into a fresh cache; MB/s is
the corpus's size over the wall time of the whole preparation, cluster start-up included (a local
Dask cluster starts its scheduler and worker processes for each preparation). Each executor's
fastest run is taken (other processes only ever slow a run down), the median printed beside it, and
the script checks that both executors write byte-identical shards.

What two cores can show: only the cost of running the same tasks through Dask instead of a process
pool (scheduling, serialising each chunk and result, the start-up of a cluster), not the gain of a
cluster, which is more machines.

    python bench/prepare_dask.py [--repeats 3] [--config filters|plain|both]
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from prepare_speed import CONFIGS, measure, write_manifest

from lmlab import manifest
from lmlab.prepare import pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", choices=[*CONFIGS, "both"], default="both")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} | CPUs: {pipeline.default_workers()}")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for config in (CONFIGS if args.config == "both" else [args.config]):
            (variant,) = manifest.load(write_manifest(scratch, config))
            times: dict[str, list[float]] = {"local": [], "dask": []}
            digests, index = set(), None
            for _ in range(args.repeats):
                for executor in times:
                    seconds, index, h = measure(variant, scratch, workers=2, executor=executor)
                    times[executor].append(seconds)
                    digests.add(h)
            mb = index["input_bytes"] / 2**20
            rate = {e: mb / min(t) for e, t in times.items()}
            median = {e: mb / statistics.median(t) for e, t in times.items()}
            print(f"\n[{config}] {mb:.1f} MB, {sum(index['documents'].values()):,} documents kept; runs (s): "
                  + ", ".join(f"{e} {[round(t, 1) for t in ts]}" for e, ts in times.items()))
            for executor in times:
                print(f"  {executor:5s} (2 workers) {rate[executor]:6.2f} MB/s (median {median[executor]:.2f})")
            print(f"  ratio dask / local = {rate['dask'] / rate['local']:.2f} (medians "
                  f"{median['dask'] / median['local']:.2f}); shards identical across executors: {len(digests) == 1}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
