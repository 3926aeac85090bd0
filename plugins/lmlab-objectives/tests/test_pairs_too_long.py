"""Preference pairs a row cannot hold whole are left out of the loss: the run says how many before it
trains (warnings.log), refuses when none fits, and never logs a stand-in loss for a step that scored no
pair."""

import json
import os
import subprocess
import sys
import textwrap


def _manifest(tmp_path, records: list[dict], batch_size: int = 1) -> str:
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    path = tmp_path / "rm.toml"
    path.write_text(textwrap.dedent(f"""\
        name = "rm"
        seed = 1
        [data]
        use = "preferences"
        path = "{data}"
        val_fraction = 0.25
        [tokenizer]
        use = "char"
        [objective]
        use = "reward-model"
        [model]
        n_layers = 1
        n_heads = 2
        d_model = 16
        block_size = 16
        [train]
        max_steps = 8
        batch_size = {batch_size}
        eval_every = 8
        eval_steps = 1
        log_every = 1
        sample_tokens = 0
        [tracker]
        use = "none"
        """))
    return str(path)


def _run(manifest: str, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lmlab", "run", manifest, "--out", str(tmp_path / "runs")],
                          capture_output=True, text=True, env=env, timeout=600)


SHORT = {"prompt": "ab", "chosen": "c", "rejected": "d"}
LONG = {"prompt": "abcd" * 10, "chosen": "c", "rejected": "d"}


def test_pairs_too_long_for_a_row_are_counted_and_steps_without_a_pair_log_no_loss(tmp_path):
    result = _run(_manifest(tmp_path, [SHORT if i % 4 in (0, 3) else LONG for i in range(40)]), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "default"
    warnings = (run_dir / "warnings.log").read_text()
    # 40 records, every fourth (all short) to validation: 30 training ones, 20 of them long.
    assert "20 of the 30 train documents (67%)" in warnings and "model.block_size = 16" in warnings
    assert "reward-model" in warnings
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "lr" in line]
    assert len(steps) == 8
    scored = [line for line in steps if "train_loss" in line]
    # One pair per step, most too long: some steps scored nothing and give no train_loss point.
    assert 0 < len(scored) < len(steps)
    assert all(line["train_loss"] > 0 for line in scored)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["train_loss"] == scored[-1]["train_loss"]


def test_no_pair_short_enough_for_a_row_is_refused_naming_the_block_size(tmp_path):
    result = _run(_manifest(tmp_path, [LONG] * 20), tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
    assert len(errors) == 1 and errors[0].startswith("lmlab: error: model.block_size:"), result.stderr
    assert not (tmp_path / "runs").exists()
