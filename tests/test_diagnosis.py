"""Failures that explain themselves: out of memory, a collective timeout naming the late rank, a
non-finite loss without nan-guard, and ``lmlab doctor`` on failed and finished runs."""

import json
import textwrap

import pytest
import torch

from lmlab import manifest
from lmlab.api import hookimpl
from lmlab.cli.main import main
from lmlab.collective_timeout import heartbeat, late_ranks
from lmlab.diagnose import diagnose
from lmlab.train.runner import run_variant
from support import run_cli


class OutOfMemoryAt:
    """Raises what the CUDA caching allocator raises when it cannot allocate, at step ``step``."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def lmlab_train_batch_end(self, step):
        if step == self.step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total "
                                         "capacity; 78.2 GiB already allocated)")


def test_out_of_memory_is_diagnosed_with_fixes_computed_for_the_run(tiny_manifest, tmp_path):
    (variant,) = manifest.load(tiny_manifest())
    run_dir = tmp_path / "run"
    with pytest.raises(torch.OutOfMemoryError):
        run_variant(variant, run_dir, extra_hooks=[OutOfMemoryAt(2)])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    diagnosis = summary["diagnosis"]
    assert diagnosis["kind"] == "out-of-memory"
    assert "out of memory" in diagnosis["cause"] and "in step 3 (2 completed)" in diagnosis["evidence"]
    fixes = {fix["key"]: fix for fix in diagnosis["fixes"] if fix["key"]}
    # Activation checkpointing, with the planner's figures for this model.
    assert fixes["train.checkpointing"]["value"] == "full"
    assert "saves" in fixes["train.checkpointing"]["text"] and " MB" in fixes["train.checkpointing"]["text"]
    # A smaller micro-batch, more accumulation: the same global batch of 4 sequences.
    micro = fixes["train.batch_size"]["value"]
    assert micro in (1, 2) and fixes["train.batch_size"]["also"] == {"train.grad_accum": 4 // micro}


def _oom_fixes(tiny_manifest, batch: int, accum: int, **facts) -> tuple[dict, str]:
    """The out-of-memory fixes for the tiny model at ``batch`` × ``accum``: by key, and as printed."""
    from lmlab.api.monitor import Diagnosis
    from lmlab.diagnose import memory_fixes, render

    (variant,) = manifest.load(tiny_manifest(), [f"train.batch_size={batch}", f"train.grad_accum={accum}"])
    fixes = memory_fixes(variant, {"device": "cpu", **facts})
    return {f.key: f for f in fixes if f.key}, render(Diagnosis("out-of-memory", "x", fixes=fixes).as_dict())


def test_the_smaller_micro_batch_is_printed_with_its_accumulation_keeping_the_global_batch(tiny_manifest,
                                                                                          monkeypatch):
    # The run's own activation figure rather than the planner's, to set how far the batch must shrink.
    monkeypatch.setattr("lmlab.diagnose._planned_activations", lambda variant: None)
    # 160 × 1 with activations 8× what a quarter of the memory holds: a micro-batch of 20 and 8
    # micro-batches per step, printed together (the micro-batch alone would shrink the step's batch 8×).
    fixes, text = _oom_fixes(tiny_manifest, 160, 1, activation_bytes=8e9, capacity_bytes=4e9)
    split = fixes["train.batch_size"]
    assert (split.value, split.also) == (20, {"train.grad_accum": 8})
    assert "--set train.batch_size=20 --set train.grad_accum=8" in text
    # Halving 7: no divisor of 7 near 2, so the micro-batch rounds down to 3 and the accumulation to
    # the nearest batch per step; at 7 × 3 that is 3 × 7, exact...
    fixes, text = _oom_fixes(tiny_manifest, 7, 3, activation_bytes=8e9, capacity_bytes=16e9)
    split = fixes["train.batch_size"]
    assert (split.value, split.also) == (3, {"train.grad_accum": 7})
    assert "--set train.batch_size=3 --set train.grad_accum=7" in text and "not divisible" not in split.text
    # ...at 7 × 1 it is 3 × 2, and the fix says that the batch per step changes.
    fixes, text = _oom_fixes(tiny_manifest, 7, 1, activation_bytes=8e9, capacity_bytes=16e9)
    split = fixes["train.batch_size"]
    assert split.value == 3 and split.also == {"train.grad_accum": 2}
    assert "7 is not divisible by 2" in split.text and "6 sequences per optimizer step instead of 7" in split.text


def test_a_sharded_layout_that_fits_is_named_with_its_plugin_options(tiny_manifest):
    # What each installed parallel plugin offers to save memory, the first that the planner fits into
    # these 4 GPUs: the plugin and its own option, not just the plugin's name.
    pytest.importorskip("lmlab_deepspeed")
    pytest.importorskip("lmlab_fsdp")
    fixes, text = _oom_fixes(tiny_manifest, 4, 1, device="cuda:0", capacity_bytes=80e9, device_count=4)
    layouts = [line for line in text.splitlines() if "--set parallel.use=" in line]
    assert any('--set parallel.use="deepspeed" --set parallel.stage=1)' in line and "ZeRO stage 1" in line
               for line in layouts), text
    assert any('--set parallel.use="fsdp" --set parallel.reshard_after_forward=false)' in line
               for line in layouts), text
    assert all("over 4 GPUs" in line for line in layouts)


def test_out_of_memory_on_the_host_is_recognised_from_the_allocator_message():
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 274877906944 bytes.")
    diagnosis = diagnose(exc, facts={"device": "cpu"})
    assert diagnosis.kind == "out-of-memory" and "host" in diagnosis.cause


def test_a_diverged_run_without_nan_guard_says_why_and_what_to_change(tiny_manifest, tmp_path, capsys):
    path = tiny_manifest('\n[optimizer]\nuse = "adamw"\nlr = 1e6\n')
    path.write_text(path.read_text().replace("max_steps = 6", "max_steps = 6\ngrad_clip = 0"))
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err
    assert "diagnosis: non-finite" in err
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    diagnosis = summary["diagnosis"]
    assert diagnosis["kind"] == "non-finite"
    assert "gradient clipping: off" in diagnosis["evidence"]
    keys = [fix["key"] for fix in diagnosis["fixes"]]
    assert keys[:2] == ["optimizer.lr", "train.grad_clip"] and "monitor.use" in keys
    assert diagnosis["fixes"][0]["value"] == pytest.approx(1e6 / 3, rel=1e-2)

    assert main(["doctor", str(tmp_path / "runs" / "default")]) == 0
    out = capsys.readouterr().out
    assert "failed" in out and "diagnosis: non-finite" in out and "--set optimizer.lr=" in out and "health:" in out


def test_doctor_on_a_finished_run_judges_its_health(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 400}))
    lines = [{"step": 10 * i, "train_loss": 2.0 + (1.0 if i % 2 else -1.0), "grad_norm": 150.0 + i,
              "data_wait": 0.7, "mfu": 0.31} for i in range(1, 41)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["doctor", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    verdicts = {f["name"]: f for f in report["health"]}
    assert verdicts["gradient norm"]["verdict"] == "warning" and "too large" in verdicts["gradient norm"]["detail"]
    assert verdicts["loss smoothness"]["verdict"] == "warning" and "1.000" in verdicts["loss smoothness"]["detail"]
    assert verdicts["data wait"]["verdict"] == "warning" and "70%" in verdicts["data wait"]["detail"]
    assert verdicts["MFU"]["detail"].startswith("median 31.0%")


@pytest.mark.parametrize("mfu, verdict, says", [
    (1.013, "implausible", "the peak FLOP/s estimate is too low"),  # no run beats the device's peak
    (0.012, "low", "the device mostly waits"),
    (0.31, "ok", "median 31.0%"),
])
def test_doctor_judges_mfu(tmp_path, capsys, mfu, verdict, says):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 40}))
    lines = [{"step": i, "train_loss": 2.0, "grad_norm": 1.0, "data_wait": 0.01, "mfu": mfu * (1 + (i % 3 - 1) / 100)}
             for i in range(1, 41)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["doctor", str(run_dir)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  MFU:")]
    assert line.startswith(f"  MFU: {verdict}: median {mfu:.1%}") and says in line


def test_doctor_refuses_a_folder_that_is_no_run(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_a_process_that_never_joined_is_a_start_up_timeout():
    exc = RuntimeError("DistStoreError: Timed out after 31 seconds waiting for clients. 1/2 clients joined.")
    diagnosis = diagnose(exc, facts={"device": "cpu"})
    assert diagnosis.kind == "collective-timeout" and "1 of 2 processes" in diagnosis.cause


def test_late_rank_is_the_one_that_reached_the_fewest_steps(tmp_path):
    heartbeat(tmp_path, 0, 7)
    heartbeat(tmp_path, 1, 6)
    heartbeat(tmp_path, 2, 7)
    ranks, detail = late_ranks(tmp_path)
    assert ranks == [1] and "rank 1 began step 7 (6 completed)" in detail[1]


def test_a_rank_that_began_the_same_step_long_after_the_others_is_late(tmp_path):
    folder = tmp_path / ".ranks"
    folder.mkdir()
    for rank, at in ((0, 100.0), (1, 160.0), (2, 101.0)):
        (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "step": 4, "time": at}))
    ranks, detail = late_ranks(tmp_path)
    assert ranks == [1] and detail[1] == "rank 1 began step 5 (4 completed), 60 s after the first rank"
    (folder / "rank1.json").write_text(json.dumps({"rank": 1, "step": 4, "time": 102.0}))
    assert late_ranks(tmp_path) is None


STALL = """
import os, time
from lmlab.train import recorder

_start = recorder.RunRecorder.on_train_batch_start

def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
    if trainer.global_rank == 1 and trainer.global_step == 2:
        # Rank 1 stalls before step 3, as a rank stuck reading its data would (a loop: a signal's
        # handler may cut one long sleep short).
        deadline = time.monotonic() + 24
        while time.monotonic() < deadline:
            time.sleep(0.5)
    return _start(self, trainer, pl_module, batch, batch_idx)

recorder.RunRecorder.on_train_batch_start = on_train_batch_start
"""


@pytest.mark.exclusive
@pytest.mark.slow
def test_a_collective_timeout_names_the_late_rank(tiny_manifest, tmp_path):
    # A sitecustomize module reaches every process the run starts (the DDP launcher re-runs the
    # command for rank 1), and only for this test.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(STALL))
    path = tiny_manifest('\n[parallel]\nuse = "ddp"\ndevices = 2\naccelerator = "cpu"\ntimeout_s = 12\n', steps=6)
    done = run_cli("run", str(path), "--out", str(tmp_path / "runs"), env={"PYTHONPATH": str(site)}, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    diagnosis = summary["diagnosis"]
    assert diagnosis["kind"] == "collective-timeout", diagnosis
    assert "rank 1" in diagnosis["cause"]
    # Read when the failure happened (rank 1 still stalled), or after the teardown waited for it: either
    # way rank 1 is the one that began step 3 late.
    assert any(line.startswith("rank 1 began step 2 (1 completed)") or
               (line.startswith("rank 1 began step 3 (2 completed), ") and "after the first rank" in line)
               for line in diagnosis["evidence"]), diagnosis["evidence"]
    assert any(fix["key"] == "parallel.timeout_s" for fix in diagnosis["fixes"])
    assert "diagnosis: collective-timeout" in done.stderr


@pytest.mark.slow
def test_a_run_under_an_address_space_limit_fails_out_of_memory_with_a_split_that_fits(tiny_manifest, tmp_path):
    # Activations of about 11 GB against a 6 GB limit on the process's address space (RLIMIT_AS):
    # the allocator fails for real, and the diagnosis computes its fixes for this run and this limit.
    import resource

    path = tiny_manifest(steps=2)
    text = path.read_text().replace("n_layers = 2\nd_model = 32\nn_heads = 4\nblock_size = 16",
                                    "n_layers = 4\nd_model = 256\nn_heads = 8\nblock_size = 1024")
    path.write_text(text.replace("batch_size = 4", "batch_size = 160"))
    limit = 6 * 2**30

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "lmlab", "run", str(path), "--out", str(tmp_path / "runs")],
                          capture_output=True, text=True, preexec_fn=cap, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr[-3000:]
    diagnosis = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())["diagnosis"]
    assert diagnosis["kind"] == "out-of-memory" and "host" in diagnosis["cause"]
    fixes = {fix["key"]: fix for fix in diagnosis["fixes"] if fix["key"]}
    assert fixes["train.checkpointing"]["value"] == "full"
    micro = fixes["train.batch_size"]["value"]
    assert 160 % micro == 0 and micro <= 40  # activations of a quarter of the limit at most
    assert fixes["train.batch_size"]["also"] == {"train.grad_accum": 160 // micro}
    assert "diagnosis: out-of-memory" in done.stderr
    assert f"--set train.batch_size={micro} --set train.grad_accum={160 // micro})" in done.stderr
