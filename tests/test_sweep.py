"""A sweep killed part-way and run again ends with every variant completed once: completed variants are
skipped, the interrupted one resumes (in the same W&B run), and the rest run, here two at a time."""

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter

import pytest

from support import run_cli

SWEEP = '[sweep]\n"attention.use" = ["mha", "mqa"]\nseeds = [1, 2]\n'
VARIANTS = ["attention.use=mha,seed=1", "attention.use=mha,seed=2", "attention.use=mqa,seed=1",
            "attention.use=mqa,seed=2"]
STEPS = 120


def lmlab(*args: str, **popen):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lmlab", *args], env=env, text=True, **popen)


def wait_for(condition, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        assert proc.poll() is None, f"the sweep ended early: {proc.communicate()[1][-2000:]}"
        time.sleep(0.02)
    raise AssertionError(f"not reached within {timeout}s")


def wandb_run_ids(run_dir) -> list[str]:
    """One W&B run id per offline folder (a resumed run has one folder per process start)."""
    return [log.stem.removeprefix("run-") for log in (run_dir / "wandb").glob("offline-run-*/run-*.wandb")]


@pytest.fixture
def sweep_manifest(tiny_manifest):
    path = tiny_manifest(SWEEP, steps=STEPS, eval_every=60, checkpoint_every=20)
    path.write_text(path.read_text().replace('[tracker]\nuse = "none"', '[tracker]\nuse = "wandb"'))
    return path


@pytest.mark.parametrize("extra, key, owners", [
    # momentum is sgd's and muon's; neither is swept, so no variant could use it
    ('[optimizer]\nmomentum = 0.9\n[sweep]\n"optimizer.use" = ["lion", "adafactor"]\n', "optimizer.momentum",
     "'muon', 'sgd'"),
    # a pipeline option, on a sweep of parallel plugins none of which runs a pipeline
    ('[parallel]\nschedule = "gpipe"\n[sweep]\n"parallel.use" = ["ddp", "fsdp"]\n', "parallel.schedule",
     "'3d', 'pipeline'"),
])
def test_an_option_of_no_plugin_the_sweep_uses_is_refused_as_in_a_single_run(tiny_manifest, tmp_path, extra, key,
                                                                                owners):
    from support import refused

    path = tiny_manifest(extra)
    line = refused(run_cli("check", str(path), "-q"), key)
    assert line.endswith(owners) and "unknown option" in line
    refused(run_cli("run", str(path), "--out", str(tmp_path / "out")), key)
    assert not (tmp_path / "out").exists()


def test_an_option_of_one_swept_optimizer_applies_where_it_fits_with_a_note_elsewhere(tiny_manifest):
    from lmlab import manifest

    path = tiny_manifest('[optimizer]\nmomentum = 0.8\n[sweep]\n"optimizer.use" = ["sgd", "lion"]\n')
    result = run_cli("check", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("# note: optimizer.momentum does not apply to optimizer plugin 'lion'; ignored") == 1
    sgd, lion = manifest.load(path)
    assert sgd.options("optimizer").momentum == 0.8 and not sgd.notes
    assert "momentum" not in lion.slots["optimizer"].table()


def test_bad_input_only_the_data_shows_stops_a_sweep_with_exit_status_2(tiny_manifest, tmp_path):
    from support import refused

    # The validation split (6,000 characters) holds no window of 8,000: known once the data is prepared.
    path = tiny_manifest('[sweep]\n"model.block_size" = [16, 8000]\n', steps=2, eval_every=2)
    result = run_cli("run", str(path), "--out", str(tmp_path / "out"), "--set", "train.sample_tokens=0")
    line = refused(result, "model.block_size")
    assert line.endswith("(variant model.block_size=8000)") and "fewer than a window" in line
    assert not (tmp_path / "out" / "model.block_size=8000" / "summary.json").exists()
    # The variant that trained keeps its sweep index, so lmlab compare still finds it.
    assert (tmp_path / "out" / "model.block_size=16" / "summary.json").is_file()
    assert (tmp_path / "out" / "sweep.json").is_file()


@pytest.mark.exclusive
def test_a_killed_sweep_run_again_completes_every_variant_once(sweep_manifest, tmp_path):
    out = tmp_path / "runs"
    args = ("run", str(sweep_manifest), "--out", str(out), "--set", "train.sample_tokens=0")
    first = lmlab(*args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    second_variant = out / VARIANTS[1]
    # Kill the whole sweep as soon as the second variant has written its first checkpoint.
    wait_for(lambda: (second_variant / "checkpoints" / "last.ckpt").is_file(), first)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert json.loads((out / VARIANTS[0] / "summary.json").read_text())["status"] == "completed"
    assert not (second_variant / "summary.json").exists()
    done_before = (out / VARIANTS[0] / "summary.json").read_text()

    again = lmlab(*args, "--jobs", "2", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr[-3000:]
    assert f"[{VARIANTS[0]}] already completed; skipped" in stderr
    assert f"[{VARIANTS[1]}] resuming from its last checkpoint" in stderr

    summaries = {v: json.loads((out / v / "summary.json").read_text()) for v in VARIANTS}
    assert {v: s["status"] for v, s in summaries.items()} == dict.fromkeys(VARIANTS, "completed")
    assert all(s["steps"] == STEPS for s in summaries.values())
    assert (out / VARIANTS[0] / "summary.json").read_text() == done_before  # skipped, untouched
    steps = [json.loads(line)["step"] for line in (second_variant / "metrics.jsonl").read_text().splitlines()
             if "train_loss" in line]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # resumed: no step logged twice

    # No duplicated W&B runs: one run id per variant; the resumed variant's two offline folders share it.
    ids = {v: set(wandb_run_ids(out / v)) for v in VARIANTS}
    assert all(len(found) == 1 for found in ids.values()), ids
    assert len(set().union(*ids.values())) == 4
    assert len(wandb_run_ids(second_variant)) == 2
    assert "wandb sync" in stderr and str(out) in stderr

    index = json.loads((out / "sweep.json").read_text())
    assert index["variants"] == VARIANTS and index["groups"] == ["attention.use=mha", "attention.use=mqa"]

    # `lmlab compare` on that folder: its statistics, computed here straight from metrics.jsonl.
    shown = run_cli("compare", str(out))
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line for line in shown.stdout.splitlines()[2:4]}
    finals = {}
    for group in ("attention.use=mha", "attention.use=mqa"):
        finals[group] = [[r["val_loss"] for r in map(json.loads, (out / f"{group},seed={seed}" / "metrics.jsonl")
                                                     .read_text().splitlines()) if r.get("final")][-1]
                         for seed in (1, 2)]
        values = finals[group]
        assert f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}" in rows[group]
        assert f"{min(values):.4f}" in rows[group] and rows[group].split()[1] == "2"
    stats = pytest.importorskip("scipy.stats")
    p = stats.ttest_ind(finals["attention.use=mqa"], finals["attention.use=mha"], equal_var=False).pvalue
    assert f" {p:.2g} " in rows["attention.use=mqa"] and "baseline" in rows["attention.use=mha"]


def test_offline_wandb_runs_read_back_with_wandbs_own_tool_carry_grouping_keys_and_versions(tiny_manifest, tmp_path):
    path = tiny_manifest('[attention]\nuse = "gqa"\nn_kv_heads = 2\n[sweep]\n"attention.use" = ["mha", "gqa"]\n',
                         steps=2, eval_every=2)
    out = tmp_path / "runs"
    run = lmlab("run", str(path), "--out", str(out), "--set", "tracker.use=wandb", "--set", "train.sample_tokens=0",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    for variant, plugin in (("attention.use=mha", "mha"), ("attention.use=gqa", "gqa")):
        (folder,) = (out / variant / "wandb").glob("offline-run-*")
        shown = subprocess.run([wandb_cli, "leet", "inspect", "--summary", "--json", str(folder)],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr
        config = json.loads(shown.stdout)["config"]
        # Flat keys W&B's UI can group by, the same for every variant of the sweep (null where an
        # option does not apply: mha has no n_kv_heads), and the seedless variant name.
        assert config["attention.use"] == plugin and config["variant"] == variant
        assert config["attention.n_kv_heads"] == (None if plugin == "mha" else 2)
        assert config["attention"]["use"] == plugin  # and nested
        assert config["plugins"]["attention"] == {"name": plugin, "distribution": "lmlab-attention",
                                                  "version": config["plugins"]["attention"]["version"]}
        assert config["environment"]["torch"] and config["environment"]["lmlab"]
        assert isinstance(config["optimizer.betas"], str)  # a list, flattened so that it can be grouped by

        records = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(folder)],
                                 capture_output=True, text=True, timeout=120).stdout
        run_record = next(json.loads(line) for line in records.splitlines() if '"type":"run"' in line)
        text = json.dumps(run_record)
        assert "causal-lm" in text and f"attention:{plugin}" in text and path.stem in text  # job type, tag, group
    assert Counter(len(wandb_run_ids(out / v)) for v in ("attention.use=mha", "attention.use=gqa")) == {1: 2}
