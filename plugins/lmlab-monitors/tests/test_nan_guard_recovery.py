"""What nan-guard declares as its recovery from non-finite steps (``Monitor.nonfinite_recovery``), which a
non-finite diagnosis suggests setting, is options of its own that do take a run through a bad step."""

import json

from lmlab.api import hookimpl
from lmlab.testing.runs import load_variant, run_variant
from lmlab_monitors.nan_guard import NanGuard


class PoisonStep:
    """Makes the last block's ffn output NaN in the forward passes of optimizer step ``step``."""

    def __init__(self, step: int):
        self.step, self.completed = step, 0

    @hookimpl
    def lmlab_model_built(self, model):
        def hook(module, args, output):
            return output * float("nan") if module.training and self.completed + 1 == self.step else None

        model.get_submodule("blocks.1.ffn").register_forward_hook(hook)

    @hookimpl
    def lmlab_train_batch_end(self, step):
        self.completed = step


def test_the_declared_recovery_takes_a_run_through_a_nonfinite_step(tiny_manifest, tmp_path):
    what, options = NanGuard.nonfinite_recovery()
    assert what and NanGuard.Options(**options) != NanGuard.Options()
    table = "\n".join(f"{key} = {json.dumps(value)}" for key, value in options.items())
    path = tiny_manifest(f'\n[monitor]\nuse = ["nan-guard"]\n\n[monitor.nan-guard]\n{table}\n', steps=4)
    result = run_variant(load_variant(path), tmp_path / "run", extra_hooks=[PoisonStep(3)])
    assert result.summary["status"] == "completed" and result.summary["skipped_steps"] == 1
