"""The manual's worked plugin example, built from the manual's own text as a third party would:
installed with pip into a folder outside the repository, listed by `lmlab plugins`, and trained
from a manifest, with no change to the core."""

import os
import re
import subprocess
import sys
from pathlib import Path

from support import ROOT, run_cli

BLOCK = re.compile(r"^```\w+ file=(\S+)\n(.*?)^```", re.S | re.M)


def readme_files() -> dict[str, str]:
    return dict(BLOCK.findall((ROOT / "docs" / "guide" / "plugins.md").read_text()))


def test_readme_example_plugin_installs_lists_and_trains(tmp_path, corpus_slice):
    files = readme_files()
    assert {"lmlab-primer/pyproject.toml", "lmlab-primer/src/lmlab_primer/relu_squared.py", "primer.toml"} <= set(files)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "input.txt").write_text(corpus_slice.read_text())

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(tmp_path / "lmlab-primer")], check=True)
    env = {"PYTHONPATH": str(site)}

    listing = run_cli("plugins", "ffn", env=env)
    assert listing.returncode == 0
    assert re.search(r"relu-squared\s+lmlab-primer 0\.1\.0", listing.stdout), listing.stdout

    result = run_cli("run", str(tmp_path / "primer.toml"), "--out", str(tmp_path / "runs"),
                     "--set", "train.max_steps=4", "--set", "train.eval_every=2", "--set", "train.eval_steps=1",
                     "--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.block_size=16",
                     "--set", "train.batch_size=4", "--set", "train.sample_tokens=4", env=env)
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / "runs" / "default" / "summary.json").read_text()
    assert '"distribution": "lmlab-primer"' in summary and '"status": "completed"' in summary
    assert not Path(ROOT / "plugins" / "lmlab-primer").exists()  # nothing was added to the repository

    # The example's own tests, as its author would run them: the conformance kit passes.
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(tmp_path / "lmlab-primer" / "tests")], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert tests.returncode == 0, tests.stdout[-3000:]
    passed = re.search(r"(\d+) passed", tests.stdout)
    assert passed and int(passed.group(1)) >= 5 and "failed" not in tests.stdout, tests.stdout[-500:]
