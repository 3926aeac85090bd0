"""Preparing a corpus: filtered, split, tokenised in parallel, sharded, cached, resumable.

Three stages, each resumable, turn the data source's documents into the token shards of
:mod:`lmlab.prepare.shards`:

1. **filter** — the documents stream from the source (never all in memory) in chunks of about
   256 KiB that worker processes pass through the filters in manifest order; this process runs chunks
   too while the workers start or are busy. Corpus-level filters
   (near-duplicate removal) compare documents in the main process, in corpus order, on signatures the
   workers computed (the MinHash-LSH split of Broder 1997 / Leskovec et al., *Mining of Massive
   Datasets* ch. 3). Kept documents are assigned to the train or validation split and spooled as
   UTF-8 text in parts of about ``shard_mb``. After each part the progress is checkpointed: the
   state (``state.json``), and the corpus-level filters' state (``Filter.state_dict``) with the one
   document held back as NumPy arrays (:mod:`lmlab.prepare.checkpoint`: never a pickle).
2. **fit** — the tokenizer learns its vocabulary from the training documents, streamed from the spool
   (``Tokenizer.fit_documents``): fitted once, before any worker tokenises.
3. **tokenize** — each spooled part becomes a token shard (in worker processes when tokenising is slow
   enough to pay for starting them); each finished shard is recorded with the SHA-256 of its files.

Then ``index.json`` is written (with the SHA-256 of every shard file and tokenizer file), the spool
deleted, and the folder renamed into place. An entry is verified against those checksums before it
is used (:mod:`lmlab.prepare.entry`, once per process); a damaged one is rebuilt. The cache key
hashes the data source (its fingerprint: file contents), the tokenizer and the filters with all their
options and plugin versions, so every run that shares them reuses one copy; a build in progress lives in
``partial/<key>/`` under an exclusive lock, so concurrent runs (sweep jobs, DDP ranks) wait for one
builder instead of racing. An interrupted build resumes: spooled parts and shards whose checksums
verify are kept, the source is read again from the start but the documents already consumed are
skipped, and the result is byte-identical to an uninterrupted build, because every task is a pure
function of its input and results are taken in corpus order whatever process computed them. A
partial build that does not verify (a damaged ``state.json`` or checkpoint) starts over. Bad input
(a ``UserError``) deletes the partial build.

Splitting without knowing the corpus's length in advance: a single document is cut by characters
(its last ``val_fraction``, as nanoGPT's shakespeare_char); otherwise the k-th kept document goes to
validation when floor((k+1)·f) > floor(k·f), with f the exact fraction, so validation documents are
spread evenly and their share is exact at every prefix; the document held back until the end of the
stream goes to validation if no other did.
"""

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

import lmlab
from lmlab import discovery, pretrained
from lmlab.errors import UserError, warn
from lmlab.cache_dir import cache_root
from lmlab.prepare import entry
from lmlab.prepare.report import Progress
from lmlab.prepare.shards import FORMAT
from lmlab.prepare.stages import Build, Listener, filter_specs
from lmlab.prepare.work import Workers
from lmlab.cores import usable_cores

DEFAULT_SHARD_MB = 16.0


def default_workers() -> int:
    return usable_cores()


def cache_key(variant, source=None, tokenizer=None) -> str:
    """The cache entry's name: a hash of the data (``source``'s fingerprint, a fresh instance of the
    variant's data source by default), the filters and the tokenizer, with all their options and the
    versions of lmlab and of their plugin distributions (a new release may tokenize or filter
    differently), the tokenizer's fingerprint (the files it reads), and, for a run with [init], the
    digest of the init's fitted tokenizer (loaded into ``tokenizer``, the variant's instance, a new
    one by default)."""
    data_cls, tok_cls = variant.plugins["data"], variant.plugins["tokenizer"]
    data = source or variant.instantiate("data")
    filters = [[cls.name, variant.manifest["filter"][cls.name]] for cls in variant.plugins.get("filter", [])]
    parts = {
        "format": FORMAT,
        "data": [data_cls.name, data.fingerprint(), variant.manifest["data"]],
        "tokenizer": [tok_cls.name, variant.manifest["tokenizer"]],
        "filters": filters,
        "code": [lmlab.__version__, _plugin_versions(variant, ("data", "tokenizer", "filter"))],
    }
    tokenizer = tokenizer if tokenizer is not None else variant.instantiate("tokenizer")
    read = tokenizer.fingerprint()
    if read:  # only then, so that the keys of tokenizers without files stay as they were
        parts["tokenizer"].append(read)
    fitted = pretrained.tokenizer_digest(variant, tokenizer)
    if fitted is not None:  # [init]: the tokenizer is the init's fitted one, not fitted here
        parts["fitted_tokenizer"] = fitted
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _plugin_versions(variant, slots: tuple[str, ...]) -> dict:
    """slot.name → "distribution version" of the plugins that make the tokens; a class handed to the
    variant directly, with no entry point (tests, notebooks), by its import path."""
    out = {}
    for slot in slots:
        classes = variant.plugins.get(slot, [])
        for cls in classes if isinstance(classes, list) else [classes]:
            try:
                info = discovery.find(slot, cls.name, key=f"{slot}.use")
                out[f"{slot}.{cls.name}"] = f"{info.distribution} {info.version}"
            except UserError:
                out[f"{slot}.{cls.name}"] = f"{cls.__module__}.{cls.__qualname__}"
    return out


def prepare_corpus(variant, root: Path | None = None, workers: int | None = None, shard_mb: float | None = None,
                   listener: Listener | None = None, key: str | None = None, tokenizer=None,
                   executor=None, scheduler: str | None = None) -> Path:
    """The folder of the variant's prepared corpus: found in the cache, or built (resuming a build
    that was interrupted). ``workers``: processes that filter and tokenise, this one included (a
    local cluster's worker processes under an executor plugin). ``executor``: an executor plugin
    (``lmlab.api.Executor``) that runs the tasks instead of local processes, or its name, with
    ``scheduler`` its address option. ``tokenizer``: the variant's tokenizer instance, fitted here
    when the entry is built."""
    root = root or cache_root()
    workers = workers or default_workers()
    filters = filter_specs(variant)
    listener = listener or Progress()
    if executor is None or isinstance(executor, str):
        from lmlab.train.executors import load

        executor = load(executor or "local", scheduler, [])
    if executor is None:
        pool = Workers(workers, filters)
    else:
        from lmlab.api.executor import PreparationKit
        from lmlab.prepare.staging import ReadTask
        from lmlab.prepare.work import Worker

        pool = executor.preparation(workers, filters, listener, PreparationKit(Worker, ReadTask))
    if pool is None:
        raise UserError(f"the {executor.name} executor cannot prepare data; use the local one or dask",
                        key="--executor")
    # Filtering worker processes take about a second to start (they import their plugins): start
    # them now, while the data source's files are hashed for the cache key; stopped on a cache hit.
    # A Dask cluster starts (or is reached) now too: an unreachable scheduler is reported at once.
    with pool:
        if filters or executor is not None:
            pool.start()
        source = variant.instantiate("data")  # one instance: it may remember what it found (a file list)
        key = key or cache_key(variant, source, tokenizer)
        final = root / "tokens" / key
        if entry.problem(final) is None:
            return final
        building = root / "partial"
        try:
            building.mkdir(parents=True, exist_ok=True)
            lock = open(building / f"{key}.lock", "a+")
        except OSError as exc:
            raise UserError(f"cannot write the token cache in {root} ({exc.strerror or exc}); choose another "
                            "folder with the LMLAB_CACHE environment variable") from None
        with lock, _locked(lock, listener):
            # Again, under the lock: another process may have built or rebuilt it while we waited.
            problem = entry.problem(final)
            if problem is not None:
                if final.exists() or final.is_symlink():
                    warn(f"the token cache entry {final} is damaged ({problem}); rebuilding it")
                    _discard(final)
                shard_bytes = int((shard_mb or DEFAULT_SHARD_MB) * 2**20)
                index = Build(variant, source, key, final, building / key, workers, shard_bytes, listener, pool,
                              tokenizer).run()
                entry.remember(final, index)
    return final


def _discard(final: Path) -> None:
    try:
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        else:
            final.unlink()
    except OSError as exc:
        raise UserError(f"cannot remove the damaged token cache entry {final} ({exc.strerror or exc}); remove "
                        "it, or choose another folder with the LMLAB_CACHE environment variable") from None


@contextlib.contextmanager
def _locked(f, listener: Listener):
    """Hold an exclusive lock on the open file ``f`` (the entry's lock file) while the block runs."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; concurrent builders may duplicate work
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        listener("wait", {"lock": f.name})
        fcntl.flock(f, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
