"""The conformance kit's optimizer, tokenizer, filter, data and tracker checks: a small correct plugin of
each slot passes, and plugins broken in one specific way each fail exactly the check for it, with a
message naming what was wrong. (First-party plugins are checked in their own tests folders.)

Nothing here imports torch when the module is imported: the filter and tracker checks rebuild the
plugin under test in a fresh interpreter, which imports this module to find its class, and torch would
cost each of them seconds. So the kit is imported on first use (:func:`kit`) and the optimizers,
which need torch, are defined on first use (:func:`optimizers`).
"""

import functools
import json
import os
import random
import socket
from pathlib import Path

import numpy as np
import pytest

from lmlab.api import DataOptions, DataSource, Field, Filter, Options, Record, Table, Tokenizer, Tracker


def kit():
    """lmlab.testing (which imports torch), imported on first use."""
    import lmlab.testing

    return lmlab.testing


def failures(plugin, options=None, **settings) -> dict[str, str]:
    """check name → message, for every check the plugin fails."""
    found = {}
    for check in kit().iter_checks(plugin, options, **settings):
        try:
            check()
        except kit().ConformanceError as exc:
            found[check.name] = str(exc)
    return found


# -- optimizers ---------------------------------------------------------------------------------------

@functools.cache
def optimizers() -> dict[str, type]:
    """name → optimizer plugin: a correct one, and others broken in one way each. Defined on first use
    so that importing this module does not import torch (see the module docstring)."""
    import torch

    from lmlab.api import Optimizer

    class Momentum(Optimizer):
        """SGD with momentum, decay-False parameters in a group with weight_decay 0: correct."""

        name = "momentum"
        weight_decay = 0.1

        def groups(self, params):
            return [{"params": [p.param for p in params if p.decay], "weight_decay": self.weight_decay},
                    {"params": [p.param for p in params if not p.decay], "weight_decay": 0.0}]

        def build(self, params):
            return torch.optim.SGD(self.groups(params), lr=self.options.lr, momentum=0.9)

    class StoredLrSign(torch.optim.Optimizer):
        """Lion-like sign updates with the learning rate kept at construction, not group["lr"]."""

        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr, "weight_decay": 0.0})
            self.peak = lr

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        m = self.state[p].setdefault("m", torch.zeros_like(p))
                        m.mul_(0.9).add_(p.grad, alpha=0.1)
                        p.add_(m.sign(), alpha=-self.peak)
            return loss

    class StoredLr(Momentum):
        name = "stored-lr"
        weight_decay = 0.0  # StoredLrSign has none

        def build(self, params):
            return StoredLrSign(self.groups(params), self.options.lr)

    class ClosureTwiceSGD(torch.optim.SGD):
        def step(self, closure=None):
            if closure is not None:
                with torch.enable_grad():
                    closure()  # a "line search" probe Lightning does not expect
            return super().step(closure)

    class ClosureTwice(Momentum):
        name = "closure-twice"

        def build(self, params):
            return ClosureTwiceSGD(self.groups(params), lr=self.options.lr)

    class DecaysEverything(Momentum):
        name = "decays-everything"

        def build(self, params):
            return torch.optim.AdamW([p.param for p in params], lr=self.options.lr, weight_decay=0.1)

    class DropsNoDecay(Momentum):
        name = "drops-no-decay"

        def build(self, params):
            return torch.optim.SGD(self.groups(params)[:1], lr=self.options.lr)

    class OutsideStateSGD(torch.optim.Optimizer):
        """Momentum kept in a dict of its own, which state_dict() does not save."""

        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr, "weight_decay": 0.0})
            self.buffers = {}

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    buf = self.buffers.setdefault(p, torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"])
            return loss

    class OutsideState(Momentum):
        name = "outside-state"
        weight_decay = 0.0  # OutsideStateSGD has none

        def build(self, params):
            return OutsideStateSGD(self.groups(params), self.options.lr)

    broken = (StoredLr, ClosureTwice, DecaysEverything, DropsNoDecay, OutsideState)
    return {cls.name: cls for cls in (Momentum, *broken)}


def test_a_correct_optimizer_passes():
    kit().check_optimizer(optimizers()["momentum"])


def test_an_optimizer_that_reads_a_stored_lr_fails_naming_group_lr():
    found = failures(optimizers()["stored-lr"])
    assert set(found) == {"lr_zero", "lr_proportional"}
    assert "param_groups[i]['lr']" in found["lr_zero"] and "lr set to 0" in found["lr_zero"]
    assert "scaled by 0.25" in found["lr_proportional"]


def test_an_optimizer_that_calls_the_closure_twice_fails():
    assert set(found := failures(optimizers()["closure-twice"])) == {"closure"}
    assert "called the closure 2 times" in found["closure"]


def test_an_optimizer_that_decays_norms_and_embeddings_fails():
    found = failures(optimizers()["decays-everything"])
    assert set(found) == {"param_groups", "no_decay"}
    assert "decay False" in found["param_groups"] and "weight_decay 0.1" in found["param_groups"]
    assert "it was decayed" in found["no_decay"]


def test_an_optimizer_without_the_no_decay_group_fails_naming_the_parameters():
    found = failures(optimizers()["drops-no-decay"])
    assert set(found) == {"param_groups"}
    assert "never train" in found["param_groups"] and "tok_emb.weight" in found["param_groups"]


def test_an_optimizer_with_state_outside_optimizer_state_fails_the_state_dict_check():
    found = failures(optimizers()["outside-state"])
    assert set(found) == {"state_dict"}
    assert "optimizer.state" in found["state_dict"]


# -- tokenizers ---------------------------------------------------------------------------------------

class Chars(Tokenizer):
    """One id per character of the fitted text, then an end-of-document id: correct."""

    name = "chars"

    def __init__(self, options=None):
        super().__init__(options)
        self.chars: list[str] = []

    def fit(self, text, workdir):
        self.chars = sorted(set(text))

    def encode(self, text):
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] if i < len(self.chars) else "" for i in ids)

    @property
    def vocab_size(self):
        return len(self.chars) + 1

    @property
    def eos_id(self):
        return len(self.chars)

    def save(self, directory):
        (Path(directory) / "chars.json").write_text(json.dumps(self.chars))

    def load(self, directory):
        self.chars = json.loads((Path(directory) / "chars.json").read_text())


class DropsAChar(Chars):
    name = "drops-a-char"

    def decode(self, ids):
        return super().decode(ids).replace("q", "")


class NumpyEos(Chars):
    name = "numpy-eos"

    @property
    def eos_id(self):
        return np.int64(len(self.chars))


class PadIsEos(Chars):
    name = "pad-is-eos"

    @property
    def pad_id(self):
        return self.eos_id


class OffByOne(Chars):
    name = "off-by-one"

    @property
    def vocab_size(self):
        return len(self.chars) - 1  # one short: the last character's id lies outside

    @property
    def eos_id(self):
        return None


class ShuffledFit(Chars):
    name = "shuffled-fit"

    def fit(self, text, workdir):
        self.chars = list(set(text))
        random.shuffle(self.chars)


class NoSave(Chars):
    name = "no-save"
    save = Tokenizer.save
    load = Tokenizer.load


def test_a_correct_tokenizer_passes():
    kit().check_tokenizer(Chars)


@pytest.mark.parametrize("plugin, check, words", [
    (DropsAChar, "round_trip", "decode(encode("),
    (NumpyEos, "special_ids", "not a plain int"),
    (PadIsEos, "special_ids", "the pad id and the eos id are both"),
    (OffByOne, "vocabulary", "outside [0, vocab_size"),
    (ShuffledFit, "fit_determinism", "a second instance fitted on the same corpus"),
    (NoSave, "save_load", "loaded from what it saved has vocab_size"),
], ids=lambda value: getattr(value, "name", None))
def test_a_broken_tokenizer_fails_naming_the_problem(plugin, check, words):
    found = failures(plugin)
    assert check in found, found
    assert words in found[check]
    assert found[check].startswith(f"{plugin.name}: {check}: ")


def test_a_tokenizer_fitted_on_a_given_corpus_round_trips_that_corpus():
    with pytest.raises(kit().ConformanceError, match="round_trip"):
        kit().check_tokenizer(DropsAChar, corpus=["quiet quays"], skip=["save_load", "fit_determinism"])
    kit().check_tokenizer(DropsAChar, corpus=["plain words only"])  # no "q" to drop


# -- filters ------------------------------------------------------------------------------------------

class Lowercase(Filter):
    """Drops documents shorter than ``min_chars``, lowercases the rest: correct."""

    name = "lowercase"

    class Options(Options):
        min_chars: int = Field(10, ge=0, help="shortest document kept")

    def keep(self, text):
        return len(text) >= self.options.min_chars

    def transform(self, text):
        return text.lower()


class SeenInKeep(Filter):
    """Deduplicates inside keep(): each worker would see only its own chunks."""

    name = "seen-in-keep"

    def __init__(self, options=None):
        super().__init__(options)
        self.seen = set()

    def keep(self, text):
        new = text not in self.seen
        self.seen.add(text)
        return new


class HashSample(Filter):
    """Keeps half the documents by Python's str hash, which differs from one process to the next."""

    name = "hash-sample"

    def keep(self, text):
        return hash(text) % 2 == 0


class ReturnsNone(Filter):
    name = "returns-none"

    def transform(self, text):
        text.lower()  # forgot the return


class Dedup(Filter):
    """Exact deduplication, with a checkpointable set of hashes: correct."""

    name = "dedup"
    corpus_level = True

    def __init__(self, options=None):
        super().__init__(options)
        self.seen = set()

    def signature(self, text):
        return text.strip()

    def admit(self, signature):
        new = signature not in self.seen
        self.seen.add(signature)
        return new

    def state_dict(self):
        return {"seen": sorted(self.seen)}

    def load_state_dict(self, state):
        self.seen = set(state["seen"])


class ForgetfulDedup(Dedup):
    name = "forgetful-dedup"

    def load_state_dict(self, state):
        pass  # what admit learnt is lost on resume


class SetStateDedup(Dedup):
    name = "set-state-dedup"

    def state_dict(self):
        return {"seen": self.seen}  # a set: not a JSON value, and prepare never pickles


class WeighingDedup(Dedup):
    """A repeat is kept with weight 0.5, and the report counts repeats: correct."""

    name = "weighing-dedup"

    def __init__(self, options=None):
        super().__init__(options)
        self.repeats = 0

    def admit(self, signature):
        if super().admit(signature):
            return 1.0
        self.repeats += 1
        return 0.5

    def state_dict(self):
        return {"seen": sorted(self.seen), "repeats": self.repeats}

    def load_state_dict(self, state):
        self.seen, self.repeats = set(state["seen"]), state["repeats"]

    def report(self):
        return [Table("repeats", ("documents", "repeats"), ((len(self.seen) + self.repeats, self.repeats),))]


class WeightsForgotten(WeighingDedup):
    name = "weights-forgotten"

    def load_state_dict(self, state):
        self.repeats = state["repeats"]  # the seen set is lost: repeats after a resume weigh 1.0, not 0.5


class ReportOutsideState(WeighingDedup):
    name = "report-outside-state"

    def admit(self, signature):
        self.admitted = getattr(self, "admitted", 0) + 1  # not in state_dict
        return super().admit(signature)

    def report(self):
        return [Table("admitted", ("documents",), ((getattr(self, "admitted", 0),),))]


class ReportNotTables(WeighingDedup):
    name = "report-not-tables"

    def report(self):
        return {"repeats": self.repeats}


class ShuffledDedup(Dedup):
    """Exact deduplication that a partitioned index can decide (API 1.14): correct."""

    name = "shuffled-dedup"

    def shuffle_keys(self, signature):
        return [signature.encode()]

    def admit_among(self, signature, candidates):
        return not candidates


class CoarseKeys(ShuffledDedup):
    name = "coarse-keys"

    def shuffle_keys(self, signature):
        return [signature[:1].encode()]  # documents that merely start alike look like duplicates


class IgnoresCandidates(ShuffledDedup):
    name = "ignores-candidates"

    def admit_among(self, signature, candidates):
        return True


def test_correct_filters_pass():
    kit().check_filter(Lowercase)
    kit().check_filter(Lowercase, {"min_chars": 40})
    kit().check_filter(Dedup)
    kit().check_filter(WeighingDedup)
    kit().check_filter(ShuffledDedup)


@pytest.mark.parametrize("plugin, check, words", [
    (SeenInKeep, "per_document", "second pass"),
    (HashSample, "worker_process", "PYTHONHASHSEED"),
    (ReturnsNone, "outputs", "returned a segment Segment(text=None"),
    (ForgetfulDedup, "state_dict", "load_state_dict does not restore what admit learnt"),
    (SetStateDedup, "state_dict", "holds a set"),
    (WeightsForgotten, "state_dict", "weighs document"),
    (ReportOutsideState, "state_dict", "reports other tables"),
    (ReportNotTables, "report", "list of lmlab.api.Table"),
    (CoarseKeys, "shuffle_keys", "a partitioned index would decide otherwise"),
    (IgnoresCandidates, "shuffle_keys", "a partitioned index would decide otherwise"),
], ids=lambda value: getattr(value, "name", None))
def test_a_broken_filter_fails_naming_the_problem(plugin, check, words):
    found = failures(plugin)
    assert set(found) == {check}, found
    assert words in found[check]


def test_a_filter_that_does_not_pickle_fails_the_worker_check():
    class Local(Lowercase):  # defined in a function: a worker cannot import it by name
        name = "local"

    found = failures(Local)
    assert set(found) == {"worker_process"}
    assert "do not pickle" in found["worker_process"]


def test_filters_are_checked_on_given_documents_too():
    with pytest.raises(kit().ConformanceError, match="per_document"):
        kit().check_filter(SeenInKeep, documents=["a", "b", "a", Record.prompt_response("q", "a")])


# -- data sources -------------------------------------------------------------------------------------

class LinesOptions(DataOptions):
    path: str = Field(..., help="a text file, one document per non-blank line")


class Lines(DataSource):
    """One document per non-blank line; blank lines counted: correct."""

    name = "lines"
    Options = LinesOptions
    yields_records = False

    def documents(self):
        self.blank = 0
        for line in Path(self.options.path).read_text().splitlines():
            if line.strip():
                yield line
            else:
                self.blank += 1

    def stats(self):
        return {"blank_lines": self.blank}


class RecordsDespiteDeclaring(Lines):
    name = "records-despite-declaring"

    def documents(self):
        for line in super().documents():
            yield Record.prompt_response("Q: ", line)


class ShuffledLines(Lines):
    name = "shuffled-lines"

    def documents(self):
        lines = list(super().documents())
        random.shuffle(lines)
        yield from lines


class CountsForever(Lines):
    name = "counts-forever"

    def documents(self):
        total = getattr(self, "total", 0)
        yield from super().documents()
        self.total = total + self.blank

    def stats(self):
        return {"blank_lines": self.total}


@pytest.fixture
def lines_file(tmp_path) -> dict:
    path = tmp_path / "lines.txt"
    path.write_text("first document\n\nsecond one\nthird, and the last\n\n")
    return {"path": str(path)}


def test_a_correct_data_source_passes(lines_file):
    kit().check_data(Lines, lines_file)


@pytest.mark.parametrize("plugin, check, words", [
    (RecordsDespiteDeclaring, "documents", "declares yields_records = False"),
    (ShuffledLines, "determinism", "yielded document"),
    (CountsForever, "stats", "counts must restart"),
], ids=lambda value: getattr(value, "name", None))
def test_a_broken_data_source_fails_naming_the_problem(plugin, check, words, lines_file):
    found = failures(plugin, lines_file)
    assert set(found) == {check}, found
    assert words in found[check]


def test_a_data_source_without_its_options_fails_on_the_missing_option():
    with pytest.raises(kit().ConformanceError, match="plugin_class: .*path"):
        kit().check_data(Lines)


# -- trackers (each runs in a fresh interpreter, so they live at module level) ------------------------

class JsonLines(Tracker):
    """Metrics to a file in the run folder: correct."""

    name = "jsonlines"

    def start(self, info):
        self.file = info.run_dir / "tracked.jsonl"
        with self.file.open("a") as f:
            f.write(json.dumps({"start": info.name, "resume": info.resume}) + "\n")

    def log(self, metrics, step):
        with self.file.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def finish(self, summary, status):
        with self.file.open("a") as f:
            f.write(json.dumps({"status": status}) + "\n")


class WritesTheKey(JsonLines):
    name = "writes-the-key"

    def start(self, info):
        super().start(info)
        settings = {"project": "x", "api_key": os.environ.get("WANDB_API_KEY")}
        (info.run_dir / "settings.json").write_text(json.dumps(settings))


class WritesHome(JsonLines):
    name = "writes-home"

    def finish(self, summary, status):
        super().finish(summary, status)
        (Path.home() / ".writes-home").mkdir(exist_ok=True)
        (Path.home() / ".writes-home" / "last_run").write_text(str(self.file))


class PhonesHome(JsonLines):
    name = "phones-home"

    def start(self, info):
        super().start(info)
        try:
            socket.create_connection(("telemetry.example.com", 443), timeout=1).close()
        except OSError:
            pass  # best effort: it never notices it had no network


class FailsOnResume(JsonLines):
    name = "fails-on-resume"

    def start(self, info):
        if info.resume:
            raise RuntimeError("no run to resume")
        super().start(info)


class CountsRuns(JsonLines):
    name = "counts-runs"

    def closing_note(self, run_dirs):
        return len(run_dirs)


def test_a_correct_tracker_passes():
    kit().check_tracker(JsonLines)


@pytest.mark.parametrize("plugin, check, words", [
    (WritesTheKey, "no_secrets", "holds $WANDB_API_KEY"),
    (WritesHome, "run_dir_only", ".writes-home/last_run"),
    (PhonesHome, "offline", "telemetry.example.com:443"),
    (FailsOnResume, "lifecycle", "start() of a resumed run raised RuntimeError: no run to resume"),
    (CountsRuns, "closing_note", "returned 1 of type int"),
], ids=lambda value: getattr(value, "name", None))
def test_a_broken_tracker_fails_naming_the_problem(plugin, check, words):
    found = failures(plugin)
    assert set(found) == {check}, found
    assert words in found[check]


def test_check_plugin_dispatches_on_the_plugin_slot(lines_file):
    kit().check_plugin(optimizers()["momentum"])
    kit().check_plugin(Lines, lines_file)
    with pytest.raises(kit().ConformanceError, match="stats"):
        kit().check_plugin(CountsForever, lines_file)
