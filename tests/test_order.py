"""The data-order slot (``[order]``, lmlab.api.Order): the first-party curricula draw exactly what the
core's curricula drew before they moved into lmlab-order, the older ``data.curriculum`` spelling is
refused while runs recorded with it still load, and a third-party order plugin works end to end from
a manifest."""

import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from lmlab import discovery
from lmlab.api import Objective, TokenSplit
from lmlab.train.batches import RandomDocuments, RandomWindows, document_spans
from lmlab.train.curriculum import build
from support import refused, run_cli, small_char_manifest
from test_discovery import fake_dist

#: Drawn with the core's lmlab.train.curriculum before the slot existed (same corpus, seed, options):
#: (first 8 documents of the order, documents of micro-batch 0, hash of 16 micro-batches of documents
#: and 8 batches of windows).
GOLDEN = {
    ("length", "linear"): ([19, 9, 5, 6, 2, 34, 23, 32], [6, 9, 19], "e7b5e5e3c5e3e9e7"),
    ("length", "root"): ([19, 9, 5, 6, 2, 34, 23, 32], [6, 9, 19], "5acab61dbaf61fa6"),
    ("rarity", "linear"): ([3, 25, 14, 36, 26, 37, 15, 4], [36, 25, 3], "2241ced2c51e86a7"),
    ("rarity", "root"): ([3, 25, 14, 36, 26, 37, 15, 4], [36, 25, 3], "e2efd42333cef1cd"),
    ("difficulty", "linear"): ([23, 12, 34, 2, 38, 8, 27, 19], [2, 12, 23], "4875fa2f50241ace"),
    ("difficulty", "root"): ([23, 12, 34, 2, 38, 8, 27, 19], [2, 12, 23], "178a5eedca10415d"),
}


def corpus(n_docs=40, seed=0):
    """Shuffled document lengths 3..n_docs+2, varied tokens, one empty document."""
    sizes = np.random.default_rng(seed).permutation(np.arange(3, n_docs + 3))
    tokens = np.concatenate([np.full(size, (i * 5) % 11 + 1, dtype=np.uint16) for i, size in enumerate(sizes)])
    tokens[::7] = 12
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return tokens, np.insert(starts, 5, starts[5])


@pytest.mark.parametrize("kind, pacing", list(GOLDEN))
def test_the_first_party_curricula_draw_what_the_core_drew(kind, pacing):
    tokens, starts = corpus()
    score = np.cos(np.arange(len(starts)) * 1.7)

    class Scored(Objective):
        def difficulty(self, split):
            return score

    data = SimpleNamespace(train=tokens, split=lambda name: TokenSplit(
        name=name, tokens=tokens, loss_mask=None, document_starts=starts, tokenizer=None))
    s, e = document_spans(tokens, starts)
    keep = np.diff(np.append(starts, len(tokens))) > 0
    cls = discovery.load("order", kind)
    plan = build(cls(cls.Options(start=0.2, steps=6, pacing=pacing)), data, Scored(), s, e, keep)
    docs = RandomDocuments(tokens, starts, 64, 3, seed=7, accum=2, curriculum=plan)
    drawn = np.concatenate([docs.documents(i) for i in range(16)])
    windows = RandomWindows(tokens, 4, 5, seed=7, curriculum=plan, documents=(s, e))
    rows = np.concatenate([windows.batch(i).numpy().ravel() for i in range(8)])
    digest = hashlib.sha256(drawn.astype(np.int64).tobytes() + rows.astype(np.int64).tobytes()).hexdigest()[:16]
    assert (plan.order[:8].tolist(), docs.documents(0).tolist(), digest) == GOLDEN[kind, pacing]


def test_uniform_is_no_order_at_all():
    tokens, starts = corpus()
    s, e = document_spans(tokens, starts)
    uniform = discovery.load("order", "uniform")
    assert build(uniform(), SimpleNamespace(train=tokens), None, s, e, np.ones(len(starts), bool)) is None


def _manifest(tmp_path, tables: str, name: str = "m.toml") -> str:
    """A tiny run over 200 JSON Lines documents of different lengths, with ``tables`` added."""
    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join(json.dumps({"text": "ab " * (i % 17 + 2) + "c" * (i % 5)}) + "\n" for i in range(200)))
    return small_char_manifest(tmp_path / name, tables.replace("PATH", str(lines)))


def _summary(tmp_path, manifest: str, out: str, env: dict | None = None) -> dict:
    result = run_cli("run", manifest, "--out", str(tmp_path / out), env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((tmp_path / out / "default" / "summary.json").read_text())


ORDERED = '[data]\nuse = "jsonl"\npath = "PATH"\n[order]\nuse = "length"\nsteps = 3\n'


@pytest.fixture(scope="module")
def length_run(tmp_path_factory):
    """A 4-step run ordered by length, trained once: (its folder, its summary)."""
    tmp_path = tmp_path_factory.mktemp("length")
    summary = _summary(tmp_path, _manifest(tmp_path, ORDERED), "runs")
    return tmp_path / "runs" / "default", summary


def test_the_order_slot_trains_as_the_core_did_and_the_older_data_curriculum_spelling_is_refused(length_run,
                                                                                                  tmp_path):
    run, summary = length_run
    # the value this run had when the curricula were the core's (lmlab.train.curriculum, API 1.16)
    assert summary["val_loss"] == pytest.approx(1.41643530414218, rel=1e-6)
    provenance = json.loads((run / "provenance.json").read_text())
    assert provenance["plugins"]["order"]["distribution"] == "lmlab-order"
    old = _manifest(tmp_path, '[data]\nuse = "jsonl"\npath = "PATH"\ncurriculum = "objective"\ncurriculum_steps = 3\n')
    line = refused(run_cli("check", old), "data.curriculum")
    assert 'moved to the order slot: write [order] use = "difficulty" with start, steps, pacing' in line


def _as_recorded_before_the_order_slot(run, into):
    """A copy of ``run`` whose manifest.toml is as lmlab recorded a curriculum before API 1.17: in
    [data], with every pacing option, and no [order] table."""
    import re
    import shutil

    shutil.copytree(run, into)
    recorded = (into / "manifest.toml").read_text()
    old = re.sub(r"\[order\]\n(.+\n)*\n?", "", recorded)
    assert "[order]" not in old
    old = old.replace("[data]\n", '[data]\ncurriculum = "length"\ncurriculum_start = 0.2\ncurriculum_steps = 3\n'
                                  'curriculum_pacing = "root"\n', 1)
    (into / "manifest.toml").write_text(old)
    return into


def test_a_run_recorded_with_the_older_data_curriculum_spelling_still_loads(length_run, tmp_path):
    from lmlab import manifest

    run, _ = length_run
    old = _as_recorded_before_the_order_slot(run, tmp_path / "old")
    (then,) = manifest.load(old / "manifest.toml", resolve_init=False)
    (now,) = manifest.load(run / "manifest.toml", resolve_init=False)
    assert then.manifest["order"] == now.manifest["order"] == {"use": "length", "start": 0.2, "steps": 3,
                                                               "pacing": "root"}
    assert then.manifest["data"] == now.manifest["data"]
    out = run_cli("generate", str(old), "--prompt", "ab", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr[-2000:]
    # as an [init] whose corpus a fine-tune replays (the init's whole manifest is loaded)
    tune = _manifest(tmp_path, f'[init]\nfrom = "{old}"\n[data]\nuse = "jsonl"\npath = "PATH"\n'
                               '[order]\nuse = "replay"\nshare = 0.5\n', "tune.toml")
    assert _summary(tmp_path, tune, "tuned")["status"] == "completed"
    # a manifest a user writes is held to today's keys
    refused(run_cli("check", str(old / "manifest.toml")), "data.curriculum")


@pytest.mark.parametrize("data, order", [
    ({"curriculum": "objective", "curriculum_start": 0.5, "curriculum_pacing": "linear"},
     {"use": "difficulty", "start": 0.5, "pacing": "linear"}),  # before API 1.17: the only spelling
    ({"curriculum": "none", "curriculum_start": 0.2, "curriculum_pacing": "root"}, None),  # no curriculum
])
def test_an_older_record_gives_its_curriculum_to_the_order_slot(data, order):
    from lmlab.upgrade import upgrade_recorded

    recorded = {"name": "x", "data": {"use": "jsonl", "path": "d.jsonl", **data}}
    upgraded = upgrade_recorded(recorded)
    assert upgraded["data"] == {"use": "jsonl", "path": "d.jsonl"} and upgraded.get("order") == order
    # API 1.17 recorded both spellings: the [order] table is the record's own
    both = upgrade_recorded({**recorded, "order": {"use": "rarity"}})
    assert both["data"] == {"use": "jsonl", "path": "d.jsonl"} and both["order"] == {"use": "rarity"}


@pytest.mark.parametrize("tables, key", [
    ('curriculum = "length"\n', "data.curriculum"),  # the older spelling of [order]
    ('curriculum_steps = 3\n[order]\nuse = "length"\n', "data.curriculum_steps"),
    ('[order]\nuse = "length"\nsteps = 5\n', "order.steps"),  # past train.max_steps = 4
    ('[order]\nuse = "lenght"\n', "order.use"),
    ('[order]\nuse = "difficulty"\n', "order.use"),  # causal-lm gives no difficulty
])
def test_a_data_order_the_run_cannot_follow_is_refused_before_anything_is_written(tmp_path, tables, key):
    manifest = _manifest(tmp_path, '[data]\nuse = "jsonl"\npath = "PATH"\n' + tables)
    refused(run_cli("run", manifest, "--out", str(tmp_path / "runs")), key)
    assert not (tmp_path / "runs").exists()


THIRD_PARTY = '''
"""A third party's data order, written against lmlab.api only: longest documents first, and its own
sampler, which gives odd and even steps alternate halves of the corpus."""

import json

import numpy as np

from lmlab.api import Field, Order, OrderOptions, TrainingDocuments


class AlternateOptions(OrderOptions):
    log: str = Field("", help="a file that records each pool the core asks for")
    halves: int = Field(2, ge=1, help="into how many interleaved parts the ordered documents are cut")


class Alternate(Order):
    Options = AlternateOptions

    def scores(self, documents: TrainingDocuments) -> np.ndarray:
        self.sizes = documents.ends - documents.starts
        return -self.sizes.astype(np.float64)

    def pool(self, step: int, order: np.ndarray) -> np.ndarray:
        chosen = order[step % self.options.halves::self.options.halves]
        with open(self.options.log, "a") as out:
            out.write(json.dumps({"step": step, "sizes": self.sizes[chosen].tolist()}) + "\\n")
        return chosen
'''


def test_a_third_party_order_plugin_works_end_to_end_from_a_manifest(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    fake_dist(site, "lmlab-alternate", "lmlab_alternate", THIRD_PARTY,
              {"lmlab.order": {"alternate": "lmlab_alternate:Alternate"}})
    env = {"PYTHONPATH": str(site)}
    log = tmp_path / "pools.jsonl"
    data = '[data]\nuse = "jsonl"\npath = "PATH"\n'
    bad = _manifest(tmp_path, data + '[order]\nuse = "alternate"\nhalves = "two"\n', "bad.toml")
    refused(run_cli("check", bad, env=env), "order.halves")
    manifest = _manifest(tmp_path, data + f'[order]\nuse = "alternate"\nlog = "{log}"\n')
    assert run_cli("check", manifest, env=env).returncode == 0
    summary = _summary(tmp_path, manifest, "runs", env=env)
    assert summary["status"] == "completed" and summary["steps"] == 4
    pools = [json.loads(line) for line in log.read_text().splitlines()]
    by_step = {p["step"]: p["sizes"] for p in pools}
    assert set(range(4)) <= set(by_step)
    for step, sizes in by_step.items():
        assert sizes == sorted(sizes, reverse=True)  # its own order: longest first
        assert by_step[step % 2] == sizes  # and its own sampler: a pure function of the step
    assert by_step[0] != by_step[1] and len(by_step[0]) + len(by_step[1]) == 200 - 20  # halves of the train docs
    run = tmp_path / "runs" / "default"
    assert '[order]\nuse = "alternate"' in (run / "manifest.toml").read_text()
    provenance = json.loads((run / "provenance.json").read_text())
    assert provenance["plugins"]["order"] == {"name": "alternate", "distribution": "lmlab-alternate",
                                              "version": "0.3"}
