"""Provenance in every run folder, and `lmlab rerun` reproducing a run and naming what differs."""

import json
import tomllib

from lmlab import provenance
from lmlab.cli.main import main


def test_a_run_records_provenance_and_rerun_reproduces_it(tiny_manifest, tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(["run", str(tiny_manifest()), "--out", str(out), "--set", "train.sample_tokens=0"]) == 0
    run_dir = out / "default"
    recorded = json.loads((run_dir / "provenance.json").read_text())
    env = recorded["environment"]
    assert env["lmlab"] and env["torch"] and env["lightning"] and env["python"] and env["device"].startswith("cpu")
    assert env["git"] == provenance.git_revision(provenance.SOURCE_DIR)  # this checkout's revision
    assert recorded["plugins"]["attention"]["distribution"] == "lmlab-attention"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["environment"] == env and summary["plugins"] == recorded["plugins"]
    capsys.readouterr()

    assert main(["rerun", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert "environment matches" in captured.err
    rerun = tmp_path / "runs-rerun" / "default"
    assert json.loads((rerun / "summary.json").read_text())["val_loss"] == summary["val_loss"]  # same machine: exact
    assert "difference +0.00e+00" in captured.out
    assert tomllib.loads((rerun / "manifest.toml").read_text()) == tomllib.loads((run_dir / "manifest.toml").read_text())

    # A run recorded elsewhere: every difference is named.
    recorded["environment"]["torch"] = "1.13.1"
    recorded["plugins"]["attention"]["version"] = "0.0.1"
    (run_dir / "provenance.json").write_text(json.dumps(recorded))
    assert main(["rerun", str(run_dir), "--out", str(tmp_path / "elsewhere")]) == 0
    err = capsys.readouterr().err
    assert "torch: 1.13.1 when recorded" in err
    assert "attention.mha: lmlab-attention 0.0.1 when recorded" in err


def test_rerun_of_a_folder_that_is_no_run_is_bad_input(tmp_path, capsys):
    assert main(["rerun", str(tmp_path)]) == 2
    assert "has no manifest.toml" in capsys.readouterr().err
