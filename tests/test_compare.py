"""`lmlab compare`: seeds pooled per variant, numbers computed from the summaries."""

import json
import statistics

from lmlab.cli.main import main


def write_run(root, name, val_loss, tokens_per_s=1000.0, status="completed"):
    (root / name).mkdir(parents=True)
    (root / name / "summary.json").write_text(json.dumps({
        "status": status, "val_loss": val_loss, "tokens_per_s": tokens_per_s, "peak_mem_mb": 100.0,
        "params": 1234}))


def test_compare_pools_seeds_and_sorts_by_loss(tmp_path, capsys):
    losses = {"attention.use=mha": [1.5, 1.7], "attention.use=mqa": [1.4, 1.45]}
    for variant, values in losses.items():
        for seed, loss in enumerate(values, 1):
            write_run(tmp_path, f"{variant},seed={seed}", loss)
    write_run(tmp_path, "attention.use=gqa,seed=1", 9.9, status="failed")
    assert main(["compare", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("attention.use=mqa") and lines[3].startswith("attention.use=mha")
    mha = f"{statistics.mean(losses['attention.use=mha']):.4f} ± {statistics.stdev(losses['attention.use=mha']):.4f}"
    assert mha in lines[3] and " 2 " in lines[3]
    assert not any("gqa" in line for line in lines)  # failed runs are not averaged in


def test_compare_on_a_folder_without_runs_is_bad_input(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert "no completed runs" in capsys.readouterr().err
