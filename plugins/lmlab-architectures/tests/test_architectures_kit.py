"""The first-party architectures, loaded by their entry-point names as lmlab loads them, pass lmlab's
conformance kit, with and without a layer pattern."""

from importlib.metadata import entry_points

import pytest

from lmlab.testing import check_architecture, iter_checks


def load(name: str) -> type:
    # Plugins import only lmlab.api from the core, so the entry point stands in for lmlab.discovery.load.
    (point,) = entry_points(group="lmlab.architecture", name=name)
    cls = point.load()
    cls.name = name
    return cls


@pytest.mark.parametrize("name", ["decoder", "parallel-block"])
def test_conforms(name):
    check_architecture(load(name))


@pytest.mark.parametrize("check", iter_checks(load("decoder"),
                                              {"layers": "AB", "mixers": {"A": {"use": "mha"}, "B": {"use": "gqa"}}}))
def test_a_layer_pattern_conforms(check):
    check()
