"""wandb passes lmlab's conformance kit for the tracker slot (offline, in the kit's sandbox), except for
one known problem, kept visible as a strict xfail: it leaves files outside the run folder (wandb's
debug logs under $HOME/.cache/wandb and $XDG_CACHE_HOME/wandb, temporary folders in $TMPDIR)."""

import pytest

from lmlab.testing import ConformanceError, iter_checks
from lmlab_wandb.wandb_tracker import WandbTracker

CHECKS = iter_checks(WandbTracker, {"tags": ["kit"]})  # one tracked session, shared by the checks
KNOWN = {"run_dir_only"}


@pytest.mark.parametrize("check", [c for c in CHECKS if c.name not in KNOWN], ids=lambda c: c.name)
def test_conformance(check):
    check()


@pytest.mark.xfail(strict=True, raises=ConformanceError,
                   reason="wandb writes outside the run folder: debug logs in $HOME/.cache/wandb/logs and "
                          "$XDG_CACHE_HOME/wandb/logs, temporary folders in $TMPDIR; remove this mark once fixed")
@pytest.mark.parametrize("check", [c for c in CHECKS if c.name in KNOWN], ids=lambda c: c.name)
def test_known_problem(check):
    check()
