"""A tensor-parallel, pipelined or 3-D run resumed from its consolidated checkpoint continues exactly as
the uninterrupted run does: each process gets back its shard or stage, and its optimizer state."""

import os
import shutil
import subprocess
import sys

import pytest

from lmlab.testing.parallel import MANIFEST, loss_trajectory, synthetic_corpus

LAYOUTS = {
    "tensor": 'use = "tensor"\ndevices = 2\naccelerator = "cpu"\ntensor_parallel_size = 2',
    "pipeline": 'use = "pipeline"\ndevices = 2\naccelerator = "cpu"',
    # Eight processes: each rank's optimizer state comes back as DTensor shards of its stage.
    "3d": 'use = "3d"\ndevices = 8\naccelerator = "cpu"\npipeline = 2\ndata = 2\ntensor = 2',
}


@pytest.mark.slow  # three two-process runs: about three minutes on two cores
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_resumed_run_continues_exactly_where_the_checkpoint_left_it(tmp_path, layout):
    corpus = synthetic_corpus(tmp_path / "corpus.txt")

    def manifest(name: str, steps: int):
        # A constant learning rate: a 10-step run's checkpoint is then the 20-step run's at step 10.
        text = MANIFEST.format(data=corpus, steps=steps, batch_size=4).replace(
            "warmup_steps = 2", 'warmup_steps = 2\nlr_schedule = "constant"').replace(
            f"checkpoint_every = {steps}", "checkpoint_every = 10")
        path = tmp_path / f"{name}.toml"
        path.write_text(f"{text}\n[parallel]\n{LAYOUTS[layout]}\n")
        return path

    def run(path, out, *more):
        result = subprocess.run([sys.executable, "-m", "lmlab", "run", str(path), "--out", str(out), *more],
                                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]

    whole, half = manifest("whole", 20), manifest("half", 10)
    run(whole, tmp_path / "whole")
    run(half, tmp_path / "half")
    # The 20-step run's folder as a kill after step 10 would leave it: its manifest, the checkpoint.
    resumed = tmp_path / "resumed" / "default"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "whole" / "default" / "manifest.toml", resumed)
    shutil.copytree(tmp_path / "whole" / "default" / "tokenizer", resumed / "tokenizer")
    shutil.copy(tmp_path / "half" / "default" / "checkpoints" / "last.ckpt", resumed / "checkpoints")
    run(whole, tmp_path / "resumed", "--resume")
    expected = loss_trajectory(tmp_path / "whole" / "default")[10:]
    got = loss_trajectory(resumed)[-10:]
    # Measured: identical (the same arithmetic in the same order).
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-6, (expected, got)
