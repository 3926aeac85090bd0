"""``lmlab prepare MANIFEST``: filters and tokenises each variant's data into the token cache.

What ``lmlab run`` does first when a variant's data is not prepared yet; running it ahead lets a
cluster job start training at once, and ``--workers`` set how many processes share the work;
``--executor dask`` runs the same tasks on a Dask cluster (the lmlab-dask executor plugin). Variants
that share their data, filters and tokenizer share one cache entry; an entry already there is only
reported. An interrupted preparation continues where it stopped when run again.
"""

import math
import sys

from lmlab import manifest
from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("manifest", help="path to a TOML manifest")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a manifest value (repeatable), e.g. --set data.val_fraction=0.05")
    parser.add_argument("--workers", "-w", type=int, metavar="N",
                        help="processes that filter and tokenise, this one included (default: one per CPU)")
    parser.add_argument("--executor", default="local", metavar="NAME",
                        help="where the tasks run: local worker processes (default), or a Dask cluster (dask, "
                             "the lmlab-dask plugin)")
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="with --executor dask: a running scheduler (tcp://host:8786); default: a local "
                             "cluster of --workers processes")
    parser.add_argument("--shard-mb", type=float, metavar="MB",
                        help="text per token shard, in MB (default 16); a resumed preparation keeps its own")


def main(args) -> int:
    if args.workers is not None and args.workers < 1:
        raise UserError("must be at least 1", key="--workers")
    if args.shard_mb is not None and not (math.isfinite(args.shard_mb) and args.shard_mb > 0):
        raise UserError(f"must be a positive number of MB, not {args.shard_mb}", key="--shard-mb")
    from lmlab.train.executors import load

    executor = load(args.executor, args.scheduler, [])  # before the manifest is read and its data hashed
    variants = manifest.load(args.manifest, args.overrides)

    from lmlab.cache_dir import cache_root
    from lmlab.prepare import entry, pipeline
    from lmlab.prepare.work import WorkerLost

    done: dict[str, list[str]] = {}
    for variant in variants:
        key = pipeline.cache_key(variant)
        if key in done:
            done[key].append(variant.name)
            continue
        done[key] = [variant.name]
        cached = entry.problem(cache_root() / "tokens" / key) is None  # verified: prepare won't hash again
        try:
            folder = pipeline.prepare_corpus(variant, workers=args.workers, shard_mb=args.shard_mb, key=key,
                                             executor=executor)
        except WorkerLost as exc:  # not bad input (exit 2): the partial build stays, to resume from
            print(f"lmlab: error: {exc}", file=sys.stderr)
            return 1
        print(f"{variant.name}: {folder}{' (already prepared)' if cached else ''}")
    return 0
