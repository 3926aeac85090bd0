"""End-to-end runs of a tiny model: the run folder DESIGN.md §5 promises, refusal to overwrite,
resume, generation."""

import json
import math
import tomllib

import torch

from lmlab.cli.main import main


def run(path, out, *extra):
    return main(["run", str(path), "--out", str(out), *extra])


def test_a_run_writes_the_promised_outputs(tiny_manifest, tmp_path, capsys):
    out = tmp_path / "runs"
    assert run(tiny_manifest(), out) == 0
    stdout = capsys.readouterr().out
    run_dir = out / "default"
    resolved = tomllib.loads((run_dir / "manifest.toml").read_text())
    assert resolved["model"]["vocab_size"] > 0 and resolved["attention"]["use"] == "mha"
    assert resolved["optimizer"]["lr"] > 0 and resolved["train"]["max_steps"] == 6

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert all({"step", "train_loss", "lr", "tokens_per_s"} <= r.keys() for r in train)
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6, 6]
    assert records[-1] == {"step": 6, "val_loss": records[-1]["val_loss"], "final": True}

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_loss"] == records[-1]["val_loss"]  # the closing full-split validation
    for key in ("val_loss", "val_ppl", "train_loss", "tokens_per_s", "wall_s", "params", "trainable_params",
                "peak_mem_mb", "steps", "plugins", "status", "activation_mb", "state_mb", "first_step_s"):
        assert summary[key] is not None, key
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert math.isclose(summary["val_ppl"], math.exp(summary["val_loss"]), rel_tol=1e-9)
    assert summary["plugins"]["attention"] == {"name": "mha", "distribution": "lmlab-attention",
                                               "version": summary["plugins"]["attention"]["version"]}
    assert summary["params"] == summary["trainable_params"] > 0

    for name in ("last.ckpt", "best.ckpt"):
        checkpoint = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert checkpoint["global_step"] == 6 or name == "best.ckpt"
    assert not list((run_dir / "checkpoints").glob(".*"))  # no temporary files left behind
    assert "val_loss" in stdout and "--- sample" in stdout


def test_running_again_skips_a_completed_run_and_refuses_a_different_manifest(tiny_manifest, tmp_path, capsys):
    out = tmp_path / "runs"
    assert run(tiny_manifest(), out) == 0
    before = (out / "default" / "summary.json").read_text()
    capsys.readouterr()
    for extra in ((), ("--resume",)):
        assert run(tiny_manifest(), out, *extra) == 0
        assert "already completed" in capsys.readouterr().err
        assert (out / "default" / "summary.json").read_text() == before

    # Another manifest's run in that folder: refused, naming the folder and the key that differs.
    assert run(tiny_manifest(), out, "--set", "optimizer.lr=0.5") == 2
    err = capsys.readouterr().err
    assert str(out / "default") in err and "optimizer.lr" in err and "--overwrite" in err
    assert (out / "default" / "summary.json").read_text() == before
    assert run(tiny_manifest(), out, "--set", "optimizer.lr=0.5", "--set", "train.sample_tokens=0",
               "--overwrite") == 0
    assert json.loads((out / "default" / "summary.json").read_text())["status"] == "completed"
    assert tomllib.loads((out / "default" / "manifest.toml").read_text())["optimizer"]["lr"] == 0.5


def test_a_failing_variant_is_recorded_and_the_sweep_goes_on(tiny_manifest, tmp_path, capsys):
    # An absurd learning rate without clipping diverges within a few steps; the sane one trains.
    path = tiny_manifest('[sweep]\n"optimizer.lr" = [1e30, 1e-3]\n', steps=4,
                         eval_every=2)
    out = tmp_path / "runs"
    assert run(path, out, "--set", "train.sample_tokens=0", "--set", "train.grad_clip=0") == 1
    err = capsys.readouterr().err
    failed = json.loads((out / "optimizer.lr=1e+30" / "summary.json").read_text())
    assert failed["status"] == "failed" and "diverged" in failed["error"]
    assert "Traceback" in (out / "optimizer.lr=1e+30" / "error.log").read_text()
    assert json.loads((out / "optimizer.lr=0.001" / "summary.json").read_text())["status"] == "completed"
    assert "1 of 2 variant(s) did not complete" in err


def test_a_variant_that_cannot_run_refuses_the_sweep_before_any_trains(tiny_manifest, tmp_path, capsys):
    # rope with mamba: mamba has no queries to rotate. Found by the checks, before mha trains.
    path = tiny_manifest('[position]\nuse = "rope"\n[sweep]\n"attention.use" = ["mha", "mamba"]\n', steps=2,
                         eval_every=2)
    out = tmp_path / "runs"
    assert run(path, out, "--set", "train.sample_tokens=0") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmlab: error: position.use:") and err.endswith("(variant attention.use=mamba)"), err
    assert not out.exists()


def test_variants_share_one_token_cache(tiny_manifest, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("LMLAB_CACHE", str(cache))
    path = tiny_manifest('[sweep]\n"attention.use" = ["mha", "mqa"]\n', steps=2, eval_every=2)
    assert run(path, tmp_path / "runs", "--set", "train.sample_tokens=0") == 0
    assert len(list((cache / "tokens").iterdir())) == 1
    assert {p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()} == {"attention.use=mha", "attention.use=mqa"}


def test_generate_continues_a_prompt_from_the_best_checkpoint(tiny_manifest, tmp_path, capsys):
    out = tmp_path / "runs"
    assert run(tiny_manifest(), out, "--set", "train.sample_tokens=0") == 0
    capsys.readouterr()
    assert main(["generate", str(out / "default"), "--prompt", "ROMEO:", "--max-new-tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text.rstrip("\n")) >= len("ROMEO:") + 1
    assert main(["generate", str(out / "default"), "--prompt", "ROMEO:", "--max-new-tokens", "12",
                 "--set", "decoding.use=sample", "--set", "decoding.top_k=5"]) == 0


def test_generate_on_a_folder_that_is_no_run_is_bad_input(tmp_path, capsys):
    assert main(["generate", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err
