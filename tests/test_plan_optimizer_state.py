"""``lmlab plan`` measures every optimizer's state, including those whose step cannot run on fake
tensors (Adafactor reads a scalar, bitsandbytes its quantisation statistics): the planner then steps
a real copy of the (small) model, and must agree with the state a real step leaves."""

from pathlib import Path

import pytest
import torch

from lmlab import manifest
from lmlab.plan import plan_variant

EXPERIMENT = Path(__file__).resolve().parents[1] / "experiments" / "shakespeare-char.toml"


def _real_state_bytes(variant) -> int:
    from lmlab.assemble import assemble

    built = assemble(variant, data=False)
    optimizer = built.plugins["optimizer"].build(built.model.param_infos())
    for p in built.model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


@pytest.mark.parametrize("name", ["adafactor", "adam8bit", "adamw"])
def test_plan_measures_the_optimizer_state_a_real_step_leaves(name, monkeypatch, tmp_path):
    if name == "adam8bit":
        pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path))
    (variant,) = manifest.load(EXPERIMENT, [f"optimizer.use={name}"])
    planned = plan_variant(variant).facts.optimizer_bytes
    assert planned == _real_state_bytes(variant)
    if name == "adam8bit":
        (adamw,) = manifest.load(EXPERIMENT, ["optimizer.use=adamw"])
        assert planned <= 0.30 * plan_variant(adamw).facts.optimizer_bytes
