"""A tensor-parallel, pipelined or 3-D run resumed from its consolidated checkpoint continues exactly as
the uninterrupted run does: each process gets back its shard or stage, and its optimizer state."""

import os
import shutil
import subprocess
import sys

import pytest

from lmlab.testing.parallel import MANIFEST, loss_trajectory, synthetic_corpus

pytestmark = pytest.mark.exclusive  # several processes at once

LAYOUTS = {
    "tensor": 'use = "tensor"\ndevices = 2\naccelerator = "cpu"\ntensor_parallel_size = 2',
    "pipeline": 'use = "pipeline"\ndevices = 2\naccelerator = "cpu"',
    # Each rank's optimizer state comes back as the FSDP (DTensor) shards of its stage. Four processes,
    # not the 2x2x2 cube: eight cost a minute more, and the tensor dimension's shards come back
    # through the same per-rank state as these (test_three_d checks the cube's checkpoint).
    "3d": 'use = "3d"\ndevices = 4\naccelerator = "cpu"\npipeline = 2\ndata = 2',
}


@pytest.mark.slow  # three runs of each layout: about two minutes on two cores
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_resumed_run_continues_exactly_where_the_checkpoint_left_it(tmp_path, layout):
    corpus = synthetic_corpus(tmp_path / "corpus.txt")

    def manifest(name: str, steps: int):
        # A constant learning rate: a 4-step run's checkpoint is then the 8-step run's at step 4.
        text = MANIFEST.format(data=corpus, steps=steps, batch_size=4).replace(
            "warmup_steps = 2", 'warmup_steps = 2\nlr_schedule = "constant"').replace(
            f"checkpoint_every = {steps}", "checkpoint_every = 4")
        path = tmp_path / f"{name}.toml"
        path.write_text(f"{text}\n[parallel]\n{LAYOUTS[layout]}\n")
        return path

    def run(path, out, *more):
        result = subprocess.run([sys.executable, "-m", "lmlab", "run", str(path), "--out", str(out), *more],
                                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]

    whole, half = manifest("whole", 8), manifest("half", 4)
    run(whole, tmp_path / "whole")
    run(half, tmp_path / "half")
    # The 8-step run's folder as a kill after step 4 would leave it: its manifest, the checkpoint.
    resumed = tmp_path / "resumed" / "default"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "whole" / "default" / "manifest.toml", resumed)
    shutil.copytree(tmp_path / "whole" / "default" / "tokenizer", resumed / "tokenizer")
    shutil.copy(tmp_path / "half" / "default" / "checkpoints" / "last.ckpt", resumed / "checkpoints")
    run(whole, tmp_path / "resumed", "--resume")
    expected = loss_trajectory(tmp_path / "whole" / "default")[4:]
    got = loss_trajectory(resumed)[-4:]
    assert len(expected) == len(got) == 4
    # Measured: identical (the same arithmetic in the same order).
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-6, (expected, got)
