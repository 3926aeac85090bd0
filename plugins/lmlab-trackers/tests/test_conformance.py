"""none passes lmlab's conformance kit for the tracker slot."""

import pytest

from lmlab.testing import iter_checks
from lmlab_trackers.none import NoTracker


@pytest.mark.parametrize("check", iter_checks(NoTracker))
def test_conformance(check):
    check()
