"""``lmlab prepare --executor dask``: on a Dask cluster of two worker processes the shards are
byte-identical to the local executor's, the tasks really run on the workers, a near-duplicate whose
twin went to another partition is removed, a killed preparation resumes, and a scheduler that cannot
be reached is bad input."""

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmlab.api.executor import PreparationKit
from lmlab.prepare import pipeline
from lmlab.prepare.staging import ReadTask
from lmlab.prepare.work import Worker
from lmlab_dask.preparation import DaskWorkers
from test_prepare import (ENCODINGS, encodings_manifest, files_of, kill_a_few_parts_in, needs_stdlib, quiet, variant_of,
                          write_manifest)

pytestmark = pytest.mark.exclusive  # several processes at once

KIT = PreparationKit(Worker, ReadTask)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def prepare(path: Path, cache: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmlab", "prepare", str(path), *args], capture_output=True,
                          text=True, env={**ENV, "LMLAB_CACHE": str(cache)}, timeout=timeout)


@needs_stdlib
def test_two_dask_workers_give_shards_byte_identical_to_the_local_executor(tmp_path, monkeypatch):
    variant = variant_of(encodings_manifest(tmp_path))  # pii, timestamps, exact and near-duplicate removal
    local = pipeline.prepare_corpus(variant, root=tmp_path / "local", workers=1, shard_mb=0.25, listener=quiet)
    events = []
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    dask = pipeline.prepare_corpus(variant, root=tmp_path / "dask", workers=2, shard_mb=0.25, executor="dask",
                                   listener=lambda e, i: events.append((e, i)))
    # Dask's nannies set OMP_NUM_THREADS=1 (and more) in the environment of the process that starts
    # them; left there, every later child of this process (a training run) would be single-threaded.
    assert dict(os.environ) == before
    assert files_of(dask) == files_of(local)
    (executor,) = [info for event, info in events if event == "executor"]
    assert executor["workers"] == 2 and executor["scheduler"].startswith("tcp://")
    index = json.loads((dask / "index.json").read_text())
    assert len(index["shards"]["train"]) > 1 and index["filters"]["minhash-dedup"]["documents_dropped"] > 0


@needs_stdlib
def test_the_workers_read_the_source_and_this_process_only_plans(tmp_path, monkeypatch):
    from lmlab_data.text_file import TextFile

    variant = variant_of(encodings_manifest(tmp_path))
    local = pipeline.prepare_corpus(variant, root=tmp_path / "local", workers=1, shard_mb=0.05, listener=quiet)

    def refuse(self):
        raise AssertionError("the client read the source")

    # The workers are other processes: this reader is only this process's.
    monkeypatch.setattr(TextFile, "documents", refuse)
    sent = []
    submit = __import__("distributed").Client.submit

    def recording(client, fn, *args, **kwargs):
        sent.append(len(pickle.dumps(args)))
        return submit(client, fn, *args, **kwargs)

    monkeypatch.setattr("distributed.Client.submit", recording)
    events = []
    dask = pipeline.prepare_corpus(variant, root=tmp_path / "dask", workers=2, shard_mb=0.05, executor="dask",
                                   listener=lambda e, i: events.append((e, i)))
    assert files_of(dask) == files_of(local)
    assert not [info for event, info in events if event == "note"]
    # What goes to the cluster is plans (file names, references to staged text), not the corpus.
    corpus = sum(p.stat().st_size for p in ENCODINGS.glob("*.py"))
    assert len(sent) > 10 and sum(sent) < corpus / 4 and max(sent) < 8 << 10, (sum(sent), max(sent), corpus)


@needs_stdlib
def test_a_source_that_cannot_be_cut_into_parts_is_read_here_with_a_note(tmp_path, monkeypatch):
    from lmlab.api import DataSource
    from lmlab_data.text_file import TextFile

    variant = variant_of(encodings_manifest(tmp_path))
    local = pipeline.prepare_corpus(variant, root=tmp_path / "local", workers=1, shard_mb=0.25, listener=quiet)
    monkeypatch.setattr(TextFile, "parts", DataSource.parts)  # as a plugin written before API 1.16
    events = []
    dask = pipeline.prepare_corpus(variant, root=tmp_path / "dask", workers=2, shard_mb=0.25, executor="dask",
                                   listener=lambda e, i: events.append((e, i)))
    assert files_of(dask) == files_of(local)
    (note,) = [info["text"] for event, info in events if event == "note"]
    assert "'text-file' cannot be cut into parts" in note and "this process reads it" in note


@needs_stdlib
def test_the_tasks_run_on_the_cluster_s_workers_and_come_back_in_order(tmp_path):
    from lmlab.prepare.stages import filter_specs

    variant = variant_of(encodings_manifest(tmp_path))
    filters = filter_specs(variant)
    texts = [p.read_text() for p in sorted(Path(variant.manifest["data"]["path"]).parent.glob("*.py"))[:40]]
    chunks = [texts[i:i + 4] for i in range(0, len(texts), 4)]
    with DaskWorkers(2, filters, KIT) as pool:
        got = list(pool.map("filter_chunk", chunks))
        built = pool.executor.run(lambda: len(sys.modules["lmlab_dask.preparation"]._workers))
        pids = pool.executor.run(os.getpid)
    assert got == [Worker(filters).filter_chunk(chunk) for chunk in chunks]
    # Both worker processes (not this one) built the filters and ran tasks.
    assert len(built) == 2 and all(n == 1 for n in built.values()) and os.getpid() not in pids.values()


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
                    for _ in range(n))


def test_a_near_duplicate_in_another_partition_is_removed(tmp_path):
    rng = random.Random(0)
    folder = tmp_path / "docs"
    folder.mkdir()
    original = _words(rng, 400)
    words = original.split()
    words[200] = "changed"  # one word of 400: Jaccard similarity of the 5-gram sets about 0.98
    # About 600 kB of unrelated documents between the pair: the pair's chunks (about 256 KiB each)
    # are different tasks, which two workers share.
    documents = [original] + [_words(rng, 300) for _ in range(300)] + [" ".join(words)]
    for i, text in enumerate(documents):
        (folder / f"{i:04d}.txt").write_text(text)
    path = write_manifest(tmp_path, f'use = "text-file"\npath = "{folder}/*.txt"',
                          '[filter]\nuse = ["minhash-dedup"]\n')
    result = prepare(path, tmp_path / "cache", "--executor", "dask", "--workers", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    stats = json.loads((entry / "index.json").read_text())["filters"]["minhash-dedup"]
    assert stats["counts"] == {"near_duplicates": 1} and stats["documents_kept"] == len(documents) - 1
    assert "on the Dask cluster at tcp://" in result.stderr and "MB/s" in result.stderr


@needs_stdlib
def test_a_killed_dask_prepare_resumes_to_byte_identical_shards(tmp_path):
    path = encodings_manifest(tmp_path)
    args = ("--executor", "dask", "--workers", "2", "--shard-mb", "0.05")
    reference = prepare(path, tmp_path / "reference", *args)
    assert reference.returncode == 0, reference.stderr[-3000:]
    root = tmp_path / "killed"
    kill_a_few_parts_in([sys.executable, "-m", "lmlab", "prepare", str(path), *args],
                        {**ENV, "LMLAB_CACHE": str(root)}, root)
    resumed = prepare(path, root, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming an interrupted preparation" in resumed.stderr
    (done,) = (root / "tokens").iterdir()
    assert files_of(done) == files_of(tmp_path / "reference" / "tokens" / done.name)


@needs_stdlib
def test_a_dask_worker_killed_mid_prepare_is_survived_by_resuming_on_the_others(tmp_path):
    import psutil

    path = encodings_manifest(tmp_path)
    local = pipeline.prepare_corpus(variant_of(path), root=tmp_path / "local", workers=1, shard_mb=0.05,
                                    listener=quiet)
    root = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "lmlab", "prepare", str(path), "--executor", "dask", "--workers",
                                "2", "--shard-mb", "0.05"], env={**ENV, "LMLAB_CACHE": str(root)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:  # until the index has a checkpoint
            states = list(root.glob("partial/*/state.json"))
            try:
                if states and len(json.loads(states[0].read_text())["parts"]) >= 2:
                    break
            except (json.JSONDecodeError, OSError):
                pass
            time.sleep(0.02)
        # The local cluster's worker processes (each holds a shard of the deduplication index).
        workers = [p for p in psutil.Process(process.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2, [p.cmdline() for p in psutil.Process(process.pid).children()]
        os.kill(workers[0].pid, signal.SIGKILL)
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert "a Dask worker holding part of the deduplication index was lost" in stderr, stderr[-3000:]
    assert "resuming from the last checkpoint on the remaining workers" in stderr
    assert files_of(root / "tokens" / local.name) == files_of(local)


# An unreachable scheduler is one line within a bounded time: test_dask_sweep (the same connection).
@pytest.mark.parametrize("args, says", [
    (("--scheduler", "tcp://127.0.0.1:9"), "needs --executor dask"),
])
def test_a_scheduler_that_cannot_be_used_is_one_line_and_exit_2_within_a_bounded_time(tmp_path, args, says):
    path = write_manifest(tmp_path, f'use = "text-file"\npath = "{tmp_path / "a.txt"}"')
    (tmp_path / "a.txt").write_text("hello world\n" * 100)
    started = time.monotonic()
    result = prepare(path, tmp_path / "cache", *args, timeout=120)
    assert time.monotonic() - started < 60  # the connection gives up after 10 s
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
    assert len(errors) == 1 and errors[0].startswith("lmlab: error: --scheduler:") and says in errors[0], result.stderr
    assert not (tmp_path / "cache" / "tokens").exists()


@pytest.mark.slow  # a scheduler and two workers started as a user would: about half a minute
@needs_stdlib
def test_an_existing_cluster_is_used_by_address_and_left_running(tmp_path):
    dask = shutil.which("dask", path=str(Path(sys.executable).parent))
    if dask is None:
        pytest.skip("no dask command beside this Python")
    port = 8786 + os.getpid() % 1000
    address = f"tcp://127.0.0.1:{port}"
    procs = [subprocess.Popen([dask, "scheduler", "--port", str(port), "--dashboard-address", ":0"], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for _ in range(2):
            procs.append(subprocess.Popen([dask, "worker", address, "--nthreads", "1", "--nworkers", "1"], env=ENV,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        path = encodings_manifest(tmp_path)
        local = prepare(path, tmp_path / "local", "--workers", "1", "--shard-mb", "0.25")
        assert local.returncode == 0, local.stderr[-3000:]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until both workers have joined
            from distributed import Client

            try:
                with Client(address, timeout=5) as client:
                    if len(client.scheduler_info()["workers"]) == 2:
                        break
            except OSError:
                pass
            time.sleep(1)
        remote = prepare(path, tmp_path / "remote", "--executor", "dask", "--scheduler", address, "--shard-mb", "0.25")
        assert remote.returncode == 0, remote.stderr[-3000:]
        assert f"on the Dask cluster at {address} (2 worker(s)" in remote.stderr
        (entry,) = (tmp_path / "local" / "tokens").iterdir()
        assert files_of(tmp_path / "remote" / "tokens" / entry.name) == files_of(entry)
        assert all(p.poll() is None for p in procs)  # the cluster is left running
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


@pytest.mark.parametrize("name, options", [("minhash-dedup", {"threshold": 0.7, "ngram": 2}), ("exact-dedup", {})])
def test_the_index_partitioned_over_workers_decides_as_the_filter_alone_and_resumes_on_other_shards(
        tmp_path, name, options):
    from lmlab import discovery

    cls = discovery.load("filter", name)
    rng = random.Random(1)
    texts = []
    for i in range(80):  # every fourth text a copy of an earlier one with one word changed (or none)
        if i % 4 == 3:
            words = rng.choice(texts).split()
            if name == "minhash-dedup":
                words[rng.randrange(len(words))] = "changed"
            texts.append(" ".join(words))
        else:
            texts.append(_words(rng, 60))
    signatures = [cls(cls.Options(**options)).signature(t) for t in texts]
    alone = cls(cls.Options(**options))
    expected = [alone.admit(s) for s in signatures]
    assert 10 <= expected.count(False) <= 20

    def decide(admitter, signatures):
        verdicts = []
        for i in range(0, len(signatures), 7):  # chunks of 7, as the preparation folds them
            chunk = signatures[i:i + 7]
            admitter.prefetch(chunk)
            verdicts += [admitter.admit(s) for s in chunk]
            admitter.flush()
        return verdicts

    with DaskWorkers(2, [], KIT) as pool:
        first = pool.admitting(0, cls(cls.Options(**options)), tmp_path)
        got = decide(first, signatures[:40])
        state = first.state_dict()  # each shard writes its segment: arrays, no pickle
        held = [shard.sizes().result() for shard in first.shards]
        assert all(keys > 0 for keys, _ in held)  # the keys are spread over both workers
        assert sum(n for _, n in held) == got.count(True)
    # Resumed on a cluster of another size: three shards read the two shards' segments.
    with DaskWorkers(3, [], KIT) as pool:
        second = pool.admitting(0, cls(cls.Options(**options)), tmp_path)
        second.load_state_dict(state)
        got += decide(second, signatures[40:])
    assert got == expected


def test_workers_lost_more_often_than_a_preparation_survives_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    from lmlab.cli.main import main
    from lmlab.api.executor import WorkerLost

    def lost(*args, **kwargs):
        raise WorkerLost("a Dask worker holding part of the deduplication index was lost (gone), 4 times; run the "
                         "same command again to resume from the last checkpoint")

    monkeypatch.setattr(pipeline, "prepare_corpus", lost)
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("hello world\n" * 100)
    path = write_manifest(tmp_path, f'use = "text-file"\npath = "{tmp_path / "a.txt"}"')
    assert main(["prepare", str(path), "--executor", "dask"]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("lmlab: error: a Dask worker holding part of the deduplication")
    assert "run the same command again to resume" in errors[0]
