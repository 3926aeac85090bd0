"""check_compress: a correct small compressor passes, and compressors broken in one way each fail the
check that observes it (the first-party methods run it in plugins/lmlab-compress/tests)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import Compressor, Field, Options, UserError
from lmlab.testing import ConformanceError, check_compress, iter_checks


class HalfLinear(nn.Module):
    """A linear layer whose weight is stored in float16 with a per-row scale."""

    keeps_scale = True

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype=torch.float16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype))
        self.register_buffer("scale", torch.ones(out_features, 1), persistent=self.keeps_scale)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    def forward(self, x):
        return F.linear(x, self.weight.float() * self.scale, self.bias)


class VolatileHalfLinear(HalfLinear):
    keeps_scale = False  # a non-persistent buffer: in no state dict


class Half(Compressor):
    """Every linear but the head to float16 (scaled per row): correct."""

    name = "half"
    dtype = torch.float16
    layer = HalfLinear

    def compress(self, model, calibration):
        names, before, after = [], 0, 0
        for name, linear in list(model.named_modules()):
            if not isinstance(linear, nn.Linear) or name == "head":
                continue
            half = self.layer(linear.out_features, linear.in_features, linear.bias is not None, self.dtype)
            scale = linear.weight.abs().amax(1, keepdim=True).clamp_min(1e-8)
            half.weight.copy_(linear.weight / scale)
            half.scale.copy_(scale)
            if linear.bias is not None:
                half.bias.copy_(linear.bias)
            self.set_scale(half, scale)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, half)
            names.append(name)
            before += sum(t.numel() * t.element_size() for t in linear.state_dict().values())
            after += sum(t.numel() * t.element_size() for t in half.state_dict().values())
        weights = sum(model.get_submodule(n).weight.numel() for n in names)
        return {"modules": names, "summary": {"bits_per_weight": self.claimed_bits(after, weights),
                                              "linear_bytes_ratio": after / before}}

    def set_scale(self, half, scale):
        pass

    def claimed_bits(self, after, weights):
        return 8 * after / weights

    def restructure(self, model, record):
        for name in record["modules"]:
            linear = model.get_submodule(name)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    self.layer(linear.out_features, linear.in_features, linear.bias is not None, self.dtype))


class LostScale(Half):
    """Keeps the scale out of the state dict: reloaded, every row is unscaled."""

    name = "lost-scale"
    layer = VolatileHalfLinear


class Boasting(Half):
    """Stores float32 and reports 16 bits per weight."""

    name = "boasting"
    dtype = torch.float32

    def claimed_bits(self, after, weights):
        return 16.0


class GroupOptions(Options):
    group_size: int = Field(32, gt=0, help="input weights per scale")


class Careless(Half):
    """A group size it never checks: a group that divides no layer fails with a view error."""

    name = "careless"
    Options = GroupOptions

    def set_scale(self, half, scale):
        half.weight.view(-1, self.options.group_size)


class Careful(Careless):
    name = "careful"

    def check_model(self, model):
        for name, linear in model.named_modules():
            if isinstance(linear, nn.Linear) and name != "head" and linear.in_features % self.options.group_size:
                raise UserError(f"{self.options.group_size} does not divide the {linear.in_features} inputs of "
                                f"{name}", key=f"compress.{self.name}.group_size")


def failures(plugin, **settings) -> dict[str, str]:
    found = {}
    for check in iter_checks(plugin, **settings):
        try:
            check()
        except ConformanceError as exc:
            found[check.name] = str(exc)
    return found


@pytest.mark.parametrize("plugin", [Half, Careful])
def test_a_correct_small_compressor_passes(plugin):
    check_compress(plugin)


@pytest.mark.parametrize("plugin, check, observed", [
    (LostScale, "reload", "the reloaded model (restructure, then load_state_dict) computes other logits"),
    (Boasting, "size", "the summary reports bits_per_weight = 16, the saved tensors of the 12 modules it lists "
                       "give 32"),
    (Careless, "bad_options", "with group_size = 1000000 (which its Options accept): raised RuntimeError"),
])
def test_a_broken_compressor_fails_the_check_that_observes_its_bug(plugin, check, observed):
    found = failures(plugin)
    assert set(found) == {check}, found
    assert found[check].startswith(f"{plugin.name}: {check}: ") and observed in found[check], found[check]


def test_options_that_accept_anything_are_refused():
    class Loose(Half):
        name = "loose"

        class Options(Options):
            model_config = {"extra": "allow"}

    assert "accepted an unknown option" in failures(Loose)["bad_options"]
