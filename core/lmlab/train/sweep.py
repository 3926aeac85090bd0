"""A manifest's variants against its runs folder: what to skip, resume or start, and running several
at once.

Running a manifest again continues it: a variant whose folder holds a completed run of the same
resolved manifest is skipped, an interrupted or failed one resumes from its last checkpoint (or starts
over when it never wrote one), and a folder holding a run of a *different* manifest is refused rather
than mixed into it. ``--jobs N`` runs N variants as child processes of this one, each an ordinary
``lmlab run --only VARIANT`` with its share of the CPU threads and its output in the variant's
``output.log``; the parent only launches, waits and reports. Nothing here imports torch, except
through the tracker plugins that clearing a run's folder loads.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lmlab.cores import usable_cores
from lmlab.errors import UserError
from lmlab.signals import Terminated
from lmlab.rundir import load_summary, write_json

#: Keys that change how a run is reported or sampled, not what it trains: they may differ when a run
#: is continued (prefixes of dotted keys).
NOT_TRAINING = ("description", "tracker.", "decoding.", "train.sample_", "train.threads")
#: [train] keys whose default stands for a value resolution computes (lmlab.validate).
FILLED_IN = ("train.min_lr", "train.decay_steps", "train.eval_batch_size")
#: A run's own files in its folder, removed when it starts over (with those its trackers declare).
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "error.log", "provenance.json")


@dataclass
class Planned:
    variant: object  # lmlab.manifest.Variant
    run_dir: Path
    action: str  # "start", "resume", "restart" (an unfinished run with no readable checkpoint) or "skip"
    status: str | None  # what the folder held: None, "completed", "failed", "interrupted"
    reason: str = ""  # for "restart": why the earlier attempt cannot be continued


def is_main_process() -> bool:
    """False in the worker processes of a distributed launch (Lightning, torchrun, SLURM), which re-run
    the command after the main one: they must not plan, lock or delete anything of their own."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def check_out(out: Path) -> None:
    """The runs folder must be a folder this process can write in (or one it can create)."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    where = "" if existing == out else f"{existing} "
    if not existing.is_dir():
        raise UserError(f"{where}is a file, not a folder to write runs into; pick another --out", key=str(out))
    # Trying is the only test that holds for root too: os.access grants root any folder, yet a
    # read-only mount or a pseudo-filesystem (/proc, /sys) still refuses the run folder later.
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lmlab-probe-", dir=existing))
    except OSError as exc:
        raise UserError(f"{where}cannot be written to ({exc.strerror or exc}); pick another --out",
                        key=str(out)) from None


def status_of(run_dir: Path) -> str | None:
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise UserError("is a file, not a run folder; pick another --out", key=str(run_dir))
    summary = load_summary(run_dir, "move it away, or pass --overwrite to train the variant again from scratch")
    if summary is not None:
        return summary.get("status") if isinstance(summary.get("status"), str) else "unknown"
    if (run_dir / "checkpoints").is_dir() or (run_dir / "metrics.jsonl").is_file():
        return "interrupted"
    return None


def plan(variants: list, out: Path, overwrite: bool = False) -> list[Planned]:
    """One entry per variant; raises UserError for a folder that holds another manifest's run."""
    from lmlab import checkpoint

    planned = []
    for variant in variants:
        run_dir = out / variant.name
        status = None if overwrite else status_of(run_dir)
        if status is not None:
            _same_manifest(variant, run_dir)
        reason = ""
        if status is None:
            action = "start"
        elif status == "completed":
            action = "skip"
        else:
            good, bad = checkpoint.readable(run_dir)
            action = "resume" if good else "restart"
            if not good:
                reason = "; ".join(bad) if bad else "the earlier attempt left no checkpoint"
        planned.append(Planned(variant, run_dir, action, status, reason))
    return planned


def claim(run_dirs: list[Path], stack) -> dict[Path, "RunLock"]:
    """Lock each run folder (entered on ``stack``, so released with it); folder → its lock. A folder
    held by a live run raises UserError naming the holder."""
    from lmlab.train.lock import RunLock

    locks = {}
    for run_dir in run_dirs:
        locks[run_dir] = stack.enter_context(RunLock(run_dir))
        remove_orphans(run_dir)
    return locks


def remove_orphans(run_dir: Path) -> None:
    """Temporary files a killed process left behind (half-written checkpoints, summaries): nothing
    else can be writing them while we hold the folder's lock."""
    for folder in (run_dir, run_dir / "checkpoints"):
        if folder.is_dir():
            for path in folder.glob(".*.tmp"):
                if path.is_file():
                    path.unlink(missing_ok=True)


def _same_manifest(variant, run_dir: Path) -> None:
    from lmlab.tables import read_toml
    from lmlab.upgrade import upgrade_recorded
    from lmlab.variant import flatten

    # A run recorded by an older lmlab is compared in today's terms (lmlab.upgrade).
    current = flatten(variant.manifest)
    recorded = run_dir / "provenance.json"
    try:
        # The resolved manifest as JSON keeps options whose value is None, which TOML cannot hold.
        stored = flatten(upgrade_recorded(json.loads(recorded.read_text(encoding="utf-8"))["manifest"]))
        # A key it lacks is an option that did not exist when the run was made (every option is
        # resolved): the run used what is now that option's default, so it does not count.
        keys = set(stored)
    except (OSError, KeyError, TypeError, AttributeError, ValueError):  # missing, damaged, not UTF-8
        if not (run_dir / "manifest.toml").is_file():
            return  # killed before it wrote one: nothing to disagree with
        stored = flatten(upgrade_recorded(read_toml(run_dir / "manifest.toml")))
        current = {k: v for k, v in current.items() if v is not None}
        keys = set(stored) | set(current)
    keys.discard("model.vocab_size")  # filled in from the tokenizer when the run started
    # Runs from before these defaults were written into the manifest recorded None: the same values.
    keys -= {k for k in FILLED_IN if stored.get(k) is None}
    differing = sorted(k for k in keys if stored.get(k) != current.get(k) and not k.startswith(NOT_TRAINING))
    if differing:
        shown = ", ".join(f"{k}: {stored.get(k)!r} there, {current.get(k)!r} now" for k in differing[:3])
        more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
        raise UserError(f"holds a run of a different manifest ({shown}{more}); pass --out to write "
                        "elsewhere, or --overwrite to replace it", key=str(run_dir))


def clear(run_dir: Path) -> None:
    """Remove a run's own files from its folder (an attempt that left no checkpoint, or --overwrite),
    so that neither its metrics nor its tracker's remote run are mixed into the new one."""
    for name in (*RUN_FILES, *tracker_files()):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def tracker_files() -> list[str]:
    """The [run_files][lmlab.api.tracker.Tracker.run_files] of every installed tracker: the earlier
    attempt may have used a tracker this variant does not."""
    from lmlab import discovery

    names = []
    for name in sorted({info.name for info in discovery.installed().get("tracker", [])}):
        try:
            declared = discovery.load("tracker", name, key="tracker.use").run_files
        except Exception:  # noqa: BLE001 - a tracker that cannot load here wrote nothing to remove
            continue
        # Only names inside the run's folder: a path from a plugin must not reach anything else.
        names.extend(n for n in declared if isinstance(n, str) and n and n != ".." and Path(n).name == n)
    return names


def write_index(out: Path, manifest_path: str, overrides: list[str], variants: list) -> None:
    """``sweep.json`` in the runs folder: the manifest, overrides and the variants in sweep order
    (``lmlab compare`` takes its default baseline and row order from it). What executors recorded of
    the variants' jobs (``lmlab.train.executors``) is kept."""
    earlier = read_index(out)
    kept = {k: earlier[k] for k in ("executor", "jobs") if k in earlier}
    write_json(out / "sweep.json", {**kept,
        "name": variants[0].experiment, "manifest": str(Path(manifest_path).resolve()),
        "overrides": list(overrides), "variants": [v.name for v in variants],
        "groups": list(dict.fromkeys(v.group for v in variants)),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def read_index(out: Path) -> dict:
    """``sweep.json`` of the runs folder ``out`` as a dict; empty when it is missing or damaged."""
    try:
        index = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


@contextlib.contextmanager
def undone_on_refusal(out: Path, main_process: bool = True):
    """Whatever raises UserError inside (bad input, exit status 2) leaves ``out`` as it found it: a
    sweep.json written meanwhile is removed (or its earlier text put back), and so is the folder
    when this created it and nothing else is in it. Once a variant has trained (its summary.json
    is there) the index stays: ``lmlab compare`` needs it for the runs already made."""
    index = out / "sweep.json"
    created = not out.exists()
    before = index.read_bytes() if index.is_file() else None
    trained_before = _summaries(out)
    try:
        yield
    except UserError:
        if main_process and _summaries(out) <= trained_before:
            if before is not None:
                index.write_bytes(before)
            else:
                index.unlink(missing_ok=True)
            if created and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
        raise


def _summaries(out: Path) -> set[Path]:
    return set(out.glob("*/summary.json")) if out.is_dir() else set()


def read_summary(run_dir: Path) -> dict | None:
    """summary.json as a dict; None when it is missing or not a JSON object (damaged, not UTF-8)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_bytes())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def run_parallel(todo: list[Planned], jobs: int, base_argv: list[str], say,
                 locks: dict | None = None) -> dict[str, dict | None]:
    """Run ``todo`` in up to ``jobs`` child processes; variant name → its summary (None: no summary).

    ``base_argv`` is the ``lmlab run`` command line without ``--only``/``--jobs``/``--overwrite``.
    Each child gets ``usable cores // jobs`` threads (at least one): N processes that each start as
    many threads as there are cores run many times slower than one. ``locks`` (variant name → the
    RunLock this process holds on its folder) are handed to the children that run them.
    A SIGINT or SIGTERM to this process is passed on to the children, which stop as ``lmlab run``
    does (a checkpoint on SIGTERM), and is raised again once they have ended.
    """
    threads = max(1, usable_cores() // jobs)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    pending, running, results = list(todo), {}, {}
    total, done = len(todo), 0
    try:
        while pending or running:
            while pending and len(running) < jobs:
                item = pending.pop(0)
                item.run_dir.mkdir(parents=True, exist_ok=True)
                log = open(item.run_dir / "output.log", "ab")
                argv = [sys.executable, "-m", "lmlab", *base_argv, "--only", item.variant.name]
                handoff, fds = {}, ()
                if locks and item.variant.name in locks:
                    handoff, fd = locks[item.variant.name].handoff_env()
                    fds = (fd,)
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**env, **handoff},
                                        pass_fds=fds)
                log.close()
                running[proc] = item
                say(f"[{item.variant.name}] {_verb(item.action)} (pid {proc.pid}, {threads} thread(s), "
                    f"output in {item.run_dir / 'output.log'})")
            time.sleep(0.2)
            for proc in [p for p in running if p.poll() is not None]:
                item = running.pop(proc)
                done += 1
                summary = read_summary(item.run_dir)
                results[item.variant.name] = summary
                say(f"[{done}/{total}] {describe(item.variant.name, summary, proc.returncode, item.run_dir)}")
    except (KeyboardInterrupt, Terminated) as exc:
        # Each child records its run as interrupted and keeps its checkpoint (SIGTERM: writes one).
        forwarded = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
        for proc in running:
            proc.send_signal(forwarded)
        deadline = time.monotonic() + 120
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    return results


def _verb(action: str) -> str:
    return {"start": "started", "resume": "resuming from its last checkpoint",
            "restart": "starting over (the earlier attempt left no checkpoint)"}.get(action, action)


def describe(name: str, summary: dict | None, returncode: int, run_dir: Path) -> str:
    """One line on how a variant ended."""
    if summary is None:
        return f"{name}: ended without a summary (exit status {returncode}); see {run_dir / 'output.log'}"
    if summary.get("status") == "completed":
        return (f"{name}: val_loss {summary['val_loss']:.4f} | {summary.get('tokens_per_s') or 0:,.0f} tokens/s | "
                f"{summary.get('wall_s', 0):.0f}s")
    return f"{name}: {summary.get('status')}: {summary.get('error', '')}".rstrip(": ")

