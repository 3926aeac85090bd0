"""The sinusoidal, alibi and none plugins pass lmlab's conformance kit for the position slot."""

import pytest

from lmlab.testing import iter_checks
from lmlab_position.alibi import ALiBiPosition
from lmlab_position.none import NoPosition
from lmlab_position.sinusoidal import SinusoidalPosition

PLUGINS = {"sinusoidal": SinusoidalPosition, "alibi": ALiBiPosition, "none": NoPosition}
CHECKS = [(name, check) for name, plugin in PLUGINS.items() for check in iter_checks(plugin)]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[f"{name}-{c.name}" for name, c in CHECKS])
def test_conformance(check):
    check()
