"""The replay order: no curriculum, a constant share of every batch from the [init] run's corpus (the
drawing is the core's, checked in the core's tests/test_replay.py)."""

import numpy as np
import pytest
from pydantic import ValidationError

from lmlab.api import TrainingDocuments
from lmlab.testing import check_plugin_class
from lmlab_order.replay import Replay


def test_meets_the_plugin_contract_and_replays_its_share_at_every_step():
    check_plugin_class(Replay, "order")
    plugin = Replay(Replay.Options(share=0.2))
    assert plugin.replays and [plugin.replay_share(s) for s in (0, 7, 10_000)] == [0.2] * 3
    docs = TrainingDocuments(np.zeros(9, dtype=np.uint16), np.array([0, 5]), np.array([5, 9]))
    assert plugin.scores(docs) is None  # its own rows are drawn uniformly
    assert Replay().options.share == 0.05


@pytest.mark.parametrize("share", [0.0, 1.0, -0.1])
def test_a_share_outside_zero_to_one_is_refused_naming_it(share):
    with pytest.raises(ValidationError, match="share"):
        Replay.Options(share=share)
