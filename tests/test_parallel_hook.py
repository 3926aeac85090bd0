"""``Parallel.configure_model``: LMModule calls it once, with the strategy's device mesh, and what
plugins marked on parameters survives the parameters being replaced."""

import torch

from lmlab.api import Parallel
from lmlab.train.module import LMModule


class ReplacingParallel(Parallel):
    """Replaces every parameter with a new one, as ``fully_shard`` and ``distribute_tensor`` do."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def configure_model(self, model, device_mesh) -> None:
        self.calls.append((model, device_mesh))
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(p.detach().clone()))


def make_module(parallel):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    model[1].weight._no_weight_decay = True
    return LMModule(model, objective=None, optimizer=None, train_cfg={}, hooks=None, parallel=parallel)


def test_the_hook_runs_once_with_the_model_and_the_strategys_mesh():
    parallel = ReplacingParallel()
    module = make_module(parallel)
    module._device_mesh = mesh = object()  # what ModelParallelStrategy sets before configure_model
    old = module.model[0].weight
    module.configure_model()
    module.configure_model()  # Lightning calls it again for trainer.validate after fit
    assert parallel.calls == [(module.model, mesh)]
    assert module.model[0].weight is not old


def test_parameter_marks_survive_the_parameters_being_replaced():
    module = make_module(ReplacingParallel())
    module._device_mesh = object()
    module.configure_model()
    assert getattr(module.model[1].weight, "_no_weight_decay", False) is True
    assert not hasattr(module.model[0].weight, "_no_weight_decay")


def test_without_a_device_mesh_the_hook_is_not_called():
    parallel = ReplacingParallel()
    make_module(parallel).configure_model()
    assert parallel.calls == []
