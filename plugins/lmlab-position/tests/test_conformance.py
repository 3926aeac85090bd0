"""The sinusoidal, alibi, t5 and none plugins pass lmlab's conformance kit for the position slot."""

import pytest

from lmlab.testing import iter_checks
from lmlab_position.alibi import ALiBiPosition
from lmlab_position.none import NoPosition
from lmlab_position.sinusoidal import SinusoidalPosition
from lmlab_position.t5_bias import T5RelativePosition

PLUGINS = {"sinusoidal": SinusoidalPosition, "alibi": ALiBiPosition, "t5": T5RelativePosition, "none": NoPosition}
CHECKS = [(name, check) for name, plugin in PLUGINS.items() for check in iter_checks(plugin)]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[f"{name}-{c.name}" for name, c in CHECKS])
def test_conformance(check):
    check()
