"""The first-party data orders meet the plugin contract, and score documents as their papers do."""

import math

import numpy as np
import pytest

from lmlab.api import TrainingDocuments, UserError
from lmlab.testing import check_plugin_class
from lmlab_order.curricula import Length, ObjectiveScored, Rarity, Uniform, rarity


@pytest.mark.parametrize("cls", [Uniform, Length, Rarity, ObjectiveScored])
def test_meets_the_plugin_contract(cls):
    check_plugin_class(cls, "order")


def test_rarity_is_the_mean_surprise_of_a_documents_tokens():
    tokens = np.array([1, 1, 2, 3, 1, 1, 1, 2], dtype=np.uint16)
    s, e = np.array([0, 2, 4]), np.array([2, 4, 8])
    p = {1: 5 / 8, 2: 2 / 8, 3: 1 / 8}
    expected = [np.mean([-math.log(p[t]) for t in tokens[a:b]]) for a, b in zip(s, e)]
    assert rarity(tokens, s, e) == pytest.approx(expected)
    assert Rarity().scores(TrainingDocuments(tokens, s, e)) == pytest.approx(expected)


def test_uniform_orders_nothing_and_length_counts_tokens():
    docs = TrainingDocuments(np.zeros(9, dtype=np.uint16), np.array([0, 5, 6]), np.array([5, 6, 9]))
    assert Uniform().scores(docs) is None
    assert Length().scores(docs).tolist() == [5.0, 1.0, 3.0]


def test_the_pool_grows_from_the_easiest_share_to_every_document():
    order = np.arange(10, dtype=np.int64)[::-1].copy()
    plugin = Length(Length.Options(start=0.2, steps=4, pacing="linear"))
    assert plugin.pool(0, order).tolist() == [9, 8]
    assert plugin.competence(2) == pytest.approx(0.6)  # 0.2 + 0.8 · 2/4
    assert len(plugin.pool(2, order)) == math.ceil(plugin.competence(2) * 10)
    assert plugin.pool(4, order) is None  # every document: the ordinary sampling


def test_an_objective_without_a_score_is_refused():
    with pytest.raises(UserError, match="difficulty"):
        ObjectiveScored().scores(TrainingDocuments(np.zeros(4), np.array([0, 2]), np.array([2, 4])))
