"""Dask is the lmlab-dask executor plugin's dependency: without it, ``--executor dask`` is one line naming
the distribution (exit 2, no traceback), and every other path neither imports nor needs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmlab.errors import UserError
from lmlab.prepare import pipeline
from test_prepare import variant_of, write_manifest

# Installed through PYTHONPATH in the subprocess: Dask looks uninstalled, whatever this environment holds.
BLOCKER = """
import sys

class _NoDask:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dask", "distributed", "bokeh"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoDask())
"""


@pytest.fixture
def corpus_manifest(tmp_path) -> Path:
    (tmp_path / "corpus.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    return write_manifest(tmp_path, f'use = "text-file"\npath = "{tmp_path / "corpus.txt"}"')


def without_dask(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    site = tmp_path / "no-dask"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMLAB_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def prepare_without_dask(tmp_path: Path, manifest: Path, *args: str) -> subprocess.CompletedProcess:
    return without_dask(tmp_path, "-m", "lmlab", "prepare", str(manifest), "--workers", "1", *args)


def test_the_prepare_modules_import_without_dask(tmp_path):
    # Dask is imported only once the Dask executor starts: its own modules load without it too.
    modules = ["lmlab.cli.main", "lmlab.cli.prepare", "lmlab.cli.run", "lmlab.prepare.pipeline",
               "lmlab.prepare.staging", "lmlab.train.executors", "lmlab_dask.executor", "lmlab_dask.preparation",
               "lmlab_dask.key_index", "lmlab_dask.sweep"]
    done = without_dask(tmp_path, "-c", f"import {', '.join(modules)}")
    assert done.returncode == 0, done.stderr


def test_the_dask_executor_without_dask_is_one_line_naming_the_distribution(tmp_path, corpus_manifest):
    done = prepare_without_dask(tmp_path, corpus_manifest, "--executor", "dask")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("lmlab: error: --executor: ") and done.stderr.count("\n") == 1, done.stderr
    assert "pip install lmlab-dask" in done.stderr and "No module named" in done.stderr
    assert not (tmp_path / "cache" / "tokens").exists()  # refused before anything was prepared


def test_the_local_executor_neither_imports_nor_needs_dask(tmp_path, corpus_manifest):
    done = prepare_without_dask(tmp_path, corpus_manifest, "--executor", "local")
    assert done.returncode == 0, done.stderr
    (folder,) = (tmp_path / "cache" / "tokens").iterdir()
    assert (folder / "index.json").is_file()


def test_preparing_on_dask_from_python_without_it_names_the_distribution(tmp_path, corpus_manifest, monkeypatch):
    variant = variant_of(corpus_manifest)
    monkeypatch.setitem(sys.modules, "distributed", None)  # import of it fails, even when already imported
    with pytest.raises(UserError, match=r'pip install lmlab-dask') as caught:
        pipeline.prepare_corpus(variant, root=tmp_path / "cache", workers=1, executor="dask")
    assert caught.value.key == "--executor"
