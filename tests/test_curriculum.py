"""Curriculum learning (``[order] use = "length"``): the easiest documents first, on a schedule, for a
seed."""

import math

import numpy as np
import pytest

from lmlab.train.batches import RandomDocuments, RandomWindows, document_spans
from lmlab.train.curriculum import Schedule
from lmlab_order.curricula import Length, ObjectiveScored, lengths
from support import refused, run_cli, small_char_manifest


def corpus(n_docs: int = 40, seed: int = 0):
    """Documents of lengths 3..(n_docs + 2) in a shuffled order: (tokens, document starts)."""
    sizes = np.random.default_rng(seed).permutation(np.arange(3, n_docs + 3))
    tokens = np.concatenate([np.full(size, i % 7 + 1, dtype=np.uint16) for i, size in enumerate(sizes)])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return tokens, starts


def Curriculum(order, start, steps, pacing) -> Schedule:
    """``order`` paced as the first-party curricula pace it (lmlab.api.Order's competence)."""
    return Schedule(np.asarray(order, dtype=np.int64), Length(Length.Options(start=start, steps=steps, pacing=pacing)))


def available(plan: Schedule, step: int) -> int:
    pool = plan.pool(step)
    return len(plan.order) if pool is None else len(pool)


def by_length(tokens, starts, start=0.25, steps=8, pacing="linear") -> Schedule:
    s, e = document_spans(tokens, starts)
    return Curriculum(np.argsort(lengths(s, e), kind="stable"), start, steps, pacing)


def test_competence_follows_the_linear_and_root_schedules():
    linear = Curriculum(np.arange(100), 0.2, 10, "linear")
    root = Curriculum(np.arange(100), 0.2, 10, "root")
    for step in range(12):
        t = min(step / 10, 1.0)
        assert linear.plugin.competence(step) == pytest.approx(min(1.0, 0.2 + 0.8 * t))
        assert root.plugin.competence(step) == pytest.approx(min(1.0, math.sqrt(t * (1 - 0.04) + 0.04)))
        assert available(linear, step) == min(100, math.ceil(linear.plugin.competence(step) * 100))
    assert available(root, 0) == 20 and available(root, 10) == 100


def test_documents_come_from_the_easiest_share_at_every_step_and_all_of_them_after():
    tokens, starts = corpus()
    plan = by_length(tokens, starts)
    s, e = document_spans(tokens, starts)
    rank = np.empty(len(s), dtype=np.int64)
    rank[plan.order] = np.arange(len(s))
    batches = RandomDocuments(tokens, starts, block_size=64, batch_size=6, seed=3, curriculum=plan)
    for step in range(plan.plugin.options.steps):
        docs = batches.documents(step)
        assert (rank[docs] < available(plan, step)).all(), step
        assert len(set(docs.tolist())) == len(docs)  # no repeats while the available share holds enough
    # At step 0: the ten shortest documents (a quarter of 40), whose lengths are 3..12.
    first = np.concatenate([batches.documents(0) for _ in range(1)])
    assert (e[first] - s[first] <= 12).all()
    # From the last step of the ramp on, every document once per epoch, as without a curriculum.
    steps = plan.plugin.options.steps
    later = np.concatenate([batches.documents(i) for i in range(steps, steps + 40)])
    plain = RandomDocuments(tokens, starts, block_size=64, batch_size=6, seed=3)
    assert np.array_equal(later, np.concatenate([plain.documents(i) for i in range(steps, steps + 40)]))


def test_the_order_is_a_function_of_the_seed_and_step_and_resumes_exactly():
    tokens, starts = corpus()
    plan = by_length(tokens, starts)

    def drawn(seed, start=0):
        batches = RandomDocuments(tokens, starts, 64, 6, seed, start=start, curriculum=plan)
        return [batches.documents(i) for i in range(start, plan.plugin.options.steps + 2)]

    assert all(np.array_equal(a, b) for a, b in zip(drawn(1), drawn(1)))
    assert not all(np.array_equal(a, b) for a, b in zip(drawn(1), drawn(2)))
    assert all(np.array_equal(a, b) for a, b in zip(drawn(1)[3:], drawn(1, start=3)))


def test_replicas_and_accumulation_take_their_rows_of_the_single_device_batch():
    tokens, starts = corpus()
    plan = by_length(tokens, starts)
    whole = RandomDocuments(tokens, starts, 64, 8, seed=5, curriculum=plan)
    for step in range(plan.plugin.options.steps):
        parts = []
        for micro in range(2):
            for replica in range(2):
                part = RandomDocuments(tokens, starts, 64, 2, seed=5, replica=replica, replicas=2, accum=2,
                                       curriculum=plan)
                parts.append(part.documents(step * 2 + micro))
        assert np.array_equal(np.concatenate(parts), whole.documents(step))


def test_windows_start_inside_the_available_documents():
    tokens, starts = corpus()
    plan = by_length(tokens, starts, start=0.1, steps=4)
    s, e = document_spans(tokens, starts)
    batches = RandomWindows(tokens, block_size=4, batch_size=64, seed=0, curriculum=plan, documents=(s, e))
    for step in range(plan.plugin.options.steps):
        allowed = plan.order[:available(plan, step)]
        begin = batches._document_starts(step, 64)
        doc = np.searchsorted(s, begin, side="right") - 1
        assert np.isin(doc, allowed).all(), step
        # and the batch is made of the windows at those starts
        rows = batches.batch(step).numpy()
        assert np.array_equal(rows, tokens[begin[:, None] + np.arange(5)].astype(np.int64))


def _manifest(tmp_path, data: str, extra: str = "") -> str:
    return small_char_manifest(tmp_path / "m.toml", f"{data}\n{extra}\n")


def test_a_curriculum_start_outside_its_range_is_refused(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 200)
    manifest = _manifest(tmp_path, f'[data]\nuse = "text-file"\npath = "{text}"\n[order]\nuse = "length"\n'
                                   "start = 0.0")
    refused(run_cli("check", manifest), "order.start")


def test_a_score_the_objective_does_not_give_is_refused_at_check(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 200)
    manifest = _manifest(tmp_path, f'[data]\nuse = "text-file"\npath = "{text}"\n[order]\nuse = "difficulty"')
    refused(run_cli("check", manifest), "order.use")


def test_a_curriculum_over_one_document_is_refused(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 200)
    manifest = _manifest(tmp_path, f'[data]\nuse = "text-file"\npath = "{text}"\n[order]\nuse = "length"')
    refused(run_cli("run", manifest, "--out", str(tmp_path / "runs")), "order.use")


def test_a_run_with_a_curriculum_trains(tmp_path):
    import json

    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join(json.dumps({"text": "ab " * (i % 17 + 2)}) + "\n" for i in range(200)))
    manifest = _manifest(tmp_path, f'[data]\nuse = "jsonl"\npath = "{lines}"\n[order]\nuse = "rarity"\n'
                                   "steps = 3")
    result = run_cli("run", manifest, "--out", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4


def test_an_objectives_own_score_orders_the_documents():
    """``[order] use = "difficulty"``: the order is the objective's score's, one entry per document of the
    split (empty documents included, and left out of the order)."""
    from types import SimpleNamespace

    from lmlab.api import Objective, TokenSplit
    from lmlab.train.curriculum import build

    tokens, starts = corpus(n_docs=10)
    starts = np.insert(starts, 3, starts[3])  # an empty document
    score = np.arange(len(starts), dtype=float)[::-1]  # the last document is the easiest

    class Scored(Objective):
        def difficulty(self, split):
            assert split.name == "train" and len(split.document_starts) == len(starts)
            return score

    data = SimpleNamespace(train=tokens, split=lambda name: TokenSplit(
        name=name, tokens=tokens, loss_mask=None, document_starts=starts, tokenizer=None))
    s, e = document_spans(tokens, starts)
    keep = np.diff(np.append(starts, len(tokens))) > 0
    plan = build(ObjectiveScored(ObjectiveScored.Options(start=0.5, steps=4, pacing="linear")), data, Scored(), s, e,
                 keep)
    assert plan.order.tolist() == list(range(len(s)))[::-1]


def test_the_curriculum_reaches_every_document_by_the_end_of_the_run_by_default(tmp_path):
    """Unset, ``order.steps`` is the run's own ``max_steps`` (it was a fixed 1000, which a short run
    never reached), written into the resolved manifest; one past ``max_steps`` is refused."""
    from lmlab import manifest

    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join('{"text": "ab"}\n' for _ in range(20)))
    data = f'[data]\nuse = "jsonl"\npath = "{lines}"'
    order = data + '\n[order]\nuse = "length"'
    (variant,) = manifest.load(_manifest(tmp_path, order))
    assert variant.options("order").steps == 4 and variant.manifest["order"]["steps"] == 4
    (variant,) = manifest.load(_manifest(tmp_path, order), ["train.max_steps=40"])
    assert variant.options("order").steps == 40
    (plain,) = manifest.load(_manifest(tmp_path, data))
    assert "order" not in plain.manifest  # no curriculum: nothing to pace
    for verb in ("check", "run"):
        line = refused(run_cli(verb, _manifest(tmp_path, order + "\nsteps = 5"), "--out",
                               str(tmp_path / "runs")) if verb == "run" else
                       run_cli(verb, _manifest(tmp_path, order + "\nsteps = 5")), "order.steps")
        assert "train.max_steps = 4" in line
    assert not (tmp_path / "runs").exists()
