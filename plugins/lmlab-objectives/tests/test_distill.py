"""Properties of the ``distill`` objective: the loss is Hinton's soft-target loss at temperature T (checked
against a hand computation, and its gradient against T·(p_s − p_t)/N), mixed with the hard
cross-entropy by alpha; task weights mark the right documents and weigh the training loss only; a
teacher that cannot teach is refused naming ``objective.teacher``; and a student distils end to end
through the CLI."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmlab.api import IGNORE_INDEX, TokenSplit, UserError, Windows
from lmlab.api.runs import ObjectiveContext, TrainedRun
from lmlab_objectives import distill as distill_module
from lmlab_objectives.distill import Distill, DistillBatch

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "data" / "tinyshakespeare.txt"
V = 5


def objective(**options) -> Distill:
    return Distill(Distill.Options(**{"teacher": "teacher-run", **options}))


class Fixed(torch.nn.Module):
    """A model whose logits for every input are the given tensor (the student's is a leaf with a grad)."""

    def __init__(self, logits: torch.Tensor, vocab_size: int | None = None, max_context: int | None = None):
        super().__init__()
        self.logits, self.vocab_size, self.max_context = logits, vocab_size or logits.shape[-1], max_context

    def forward(self, ids):
        assert ids.shape == self.logits.shape[:2]
        return self.logits


def prepared(teacher_logits: torch.Tensor, **options) -> Distill:
    o = objective(**options)
    o.prepare(ObjectiveContext(runs={"teacher": TrainedRun(Path("t"), {}, None, Fixed(teacher_logits))},
                               tokenizer=None, generate=None))
    return o


# -- the loss against a hand computation ------------------------------------------------------------------

def softmax(row, T=1.0):
    m = max(z / T for z in row)
    e = [math.exp(z / T - m) for z in row]
    return [x / sum(e) for x in e]


def by_hand(student, teacher, targets, T, alpha, weights=None):
    """Σ_i w_i [alpha · T² · Σ_v p_t (log p_t − log p_s) + (1 − alpha) · (−log softmax(s)[y])] / Σ_i w_i
    over scored targets, in plain floats."""
    total = norm = 0.0
    for i, (s, t, y) in enumerate(zip(student, teacher, targets)):
        if y == IGNORE_INDEX:
            continue
        p_s, p_t = softmax(s, T), softmax(t, T)
        soft = T * T * sum(pt * (math.log(pt) - math.log(ps)) for pt, ps in zip(p_t, p_s))
        hard = -math.log(softmax(s)[y])
        w = 1.0 if weights is None else weights[i]
        total += w * (alpha * soft + (1 - alpha) * hard)
        norm += w
    return total / norm


STUDENT = [[0.3, -1.2, 2.0, 0.1, -0.5], [1.5, 0.2, -0.7, 0.9, 0.0], [-2.0, 0.4, 0.4, 3.1, -1.0],
           [0.0, 0.0, 1.0, -1.0, 2.5]]
TEACHER = [[1.0, -0.5, 0.8, 0.0, -2.0], [0.1, 2.2, -1.5, 0.3, 0.7], [-1.0, -1.0, 2.5, 1.0, 0.0],
           [3.0, -3.0, 0.0, 0.5, 1.0]]
TARGETS = [2, 1, IGNORE_INDEX, 4]  # one unscored position: it must count for nothing


@pytest.mark.parametrize("T", [1.0, 4.0])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_the_distillation_loss_at_temperature_t_equals_the_analytic_soft_target_loss(T, alpha):
    student = torch.tensor([STUDENT])  # (1, 4, V)
    o = prepared(torch.tensor([TEACHER]), temperature=T, alpha=alpha)
    batch = DistillBatch(torch.zeros(1, 4, dtype=torch.long), torch.tensor([TARGETS]))
    model = Fixed(student)
    loss = o.forward_loss(model, batch)
    assert loss.item() == pytest.approx(by_hand(STUDENT, TEACHER, TARGETS, T, alpha), rel=1e-5)
    reports = o.take_reports()
    soft_sum, n = reports["soft_loss"]
    assert n == 3 and soft_sum.item() / n == pytest.approx(by_hand(STUDENT, TEACHER, TARGETS, T, 1.0), rel=1e-5)
    hard_sum, _ = reports["hard_loss"]
    assert hard_sum.item() / n == pytest.approx(by_hand(STUDENT, TEACHER, TARGETS, T, 0.0), rel=1e-5)
    teacher_sum, _ = reports["teacher_hard_loss"]
    assert teacher_sum.item() / n == pytest.approx(by_hand(TEACHER, TEACHER, TARGETS, T, 0.0), rel=1e-5)


@pytest.mark.parametrize("T", [1.0, 2.0, 4.0])
def test_the_soft_gradient_is_t_times_the_difference_of_softened_probabilities(T):
    # Hinton et al. 2015, section 2.1: with the T² factor, d(soft)/d(student logit) = T · (p_s − p_t) per
    # token, divided by N for the mean; without it the gradient would shrink as 1/T.
    student = torch.tensor([STUDENT], requires_grad=True)
    o = prepared(torch.tensor([TEACHER]), temperature=T, alpha=1.0)
    o.forward_loss(Fixed(student), DistillBatch(torch.zeros(1, 4, dtype=torch.long), torch.tensor([TARGETS])))\
        .backward()
    p_s, p_t = (torch.tensor(STUDENT) / T).softmax(-1), (torch.tensor(TEACHER) / T).softmax(-1)
    expected = T * (p_s - p_t) / 3  # three scored targets
    expected[2] = 0  # the unscored position gets no gradient
    torch.testing.assert_close(student.grad[0], expected, rtol=1e-5, atol=1e-7)


def test_a_batch_with_nothing_scored_has_zero_loss_and_gradient_not_nan():
    student = torch.tensor([STUDENT], requires_grad=True)
    o = prepared(torch.tensor([TEACHER]))
    loss = o.forward_loss(Fixed(student), DistillBatch(torch.zeros(1, 4, dtype=torch.long),
                                                       torch.full((1, 4), IGNORE_INDEX)))
    loss.backward()
    assert loss.item() == 0.0 and student.grad.abs().sum() == 0


# -- batches ----------------------------------------------------------------------------------------------

def test_targets_are_the_next_tokens_scored_by_the_label_of_the_target_and_never_on_padding():
    tokens = torch.tensor([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 1]])
    # scored bit | task << 1; row 0: prompt 1 2, response 3 4, padding
    labels = torch.tensor([[0, 0, 1, 1, 1, 1], [2, 3, 3, 0, 1, 5]], dtype=torch.uint8)
    padding = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    batch = objective(task_weights={"a": 3.0, "b": 0.25}).make_batch_from(Windows(tokens, labels, padding))
    I = IGNORE_INDEX
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 0], [5, 6, 7, 8, 9]]
    assert batch.targets.tolist() == [[I, 3, 4, I, I], [6, 7, I, 9, 1]]
    assert batch.weights.tolist() == [[1.0] * 5, [3.0, 3.0, 1.0, 1.0, 0.25]]


def test_without_labels_every_next_token_is_scored_and_packing_chooses_the_sampling():
    batch = objective().make_batch_from(Windows(torch.tensor([[4, 3, 2, 1]])))
    assert batch.targets.tolist() == [[3, 2, 1]] and batch.weights is None
    assert objective().sampling == "windows" and objective(packing=False).sampling == "documents"
    assert Distill.wants_windows() and Distill.runs_model() and Distill.needs_runs == ("teacher",)


# -- task weights -----------------------------------------------------------------------------------------

class Chars:
    """A character tokenizer over a fixed alphabet (what TokenSplit.tokenizer offers)."""

    def __init__(self, text: str):
        self.alphabet = sorted(set(text))

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) for c in text]


SPEAKER, NEXT, WHO = "Who speaks this line?", "Which word comes next?", "Who"
DOCUMENTS = [
    "Who speaks this line?\nHark.\nROMEO\n",   # speaker (the longer prefix wins over "Who")
    "Which word comes next?\nTo be or\nnot\n",  # next-word
    "Who is it?\nNURSE\n",                      # only "Who"
    "Who speaks this line!\nno\n",              # a near miss of the speaker prefix: "Who"
    "Who speaks this",                           # with the next document, the speaker prefix: "Who" alone
    " line?\nyes\n",
    "plain text, no task\n",
    "Which word comes next?\nthe\nend\n",
    "Who speaks",                                # the last document, shorter than a prefix: no task, no overrun
]
DOCUMENT_TASKS = [SPEAKER, NEXT, WHO, WHO, WHO, None, None, NEXT, WHO]


def synthetic_split(with_mask: bool, name: str = "train") -> TokenSplit:
    tokenizer = Chars("".join(DOCUMENTS))
    ids = [np.array(tokenizer.encode(d), dtype=np.uint16) for d in DOCUMENTS]
    starts = np.cumsum([0] + [len(i) for i in ids[:-1]])
    tokens = np.concatenate(ids)
    mask = None
    if with_mask:  # a response: every character after the first line of each document
        mask = np.concatenate([(np.arange(len(d)) > d.index("\n")) if "\n" in d else np.zeros(len(d), bool)
                               for d in DOCUMENTS]).astype(np.uint8)
    return TokenSplit(name, tokens, mask, starts.astype(np.int64), tokenizer)


@pytest.mark.parametrize("with_mask", [False, True])
def test_task_labels_mark_the_documents_that_start_with_each_prefix(with_mask, monkeypatch):
    monkeypatch.setattr(distill_module, "DOCUMENT_CHUNK", 3)  # documents read in several chunks
    prefixes = {WHO: 2.0, SPEAKER: 4.0, NEXT: 0.5}
    split = synthetic_split(with_mask)
    labels = objective(task_weights=prefixes).token_labels(split)
    positions = np.arange(len(split.tokens))
    got = labels(positions[None, :])[0]
    assert got.dtype == np.uint8 and got.shape == positions.shape
    index = {p: i + 1 for i, p in enumerate(prefixes)}
    expected_task = np.concatenate([np.full(len(d), index.get(t, 0)) for d, t in zip(DOCUMENTS, DOCUMENT_TASKS)])
    np.testing.assert_array_equal(got >> 1, expected_task)
    expected_scored = split.loss_mask if with_mask else np.ones(len(positions), np.uint8)
    np.testing.assert_array_equal(got & 1, expected_scored)
    # any shape of positions, as the samplers ask
    grid = np.array([[0, 40], [41, len(positions) - 1]])
    np.testing.assert_array_equal(labels(grid), got[grid])


def test_without_task_weights_labels_are_the_loss_mask_or_nothing():
    split = synthetic_split(with_mask=True)
    labels = objective().token_labels(split)
    np.testing.assert_array_equal(labels(np.array([[0, 25, 26]])), split.loss_mask[[[0, 25, 26]]])
    assert objective().token_labels(synthetic_split(with_mask=False)) is None


def test_a_prefix_that_starts_no_training_document_is_refused_naming_task_weights():
    with pytest.raises(UserError, match="Who speaks this line[?] ") as info:
        objective(task_weights={"Who speaks this line? ": 2.0}).token_labels(synthetic_split(False))
    assert info.value.key == "objective.task_weights"
    # a held-out split may lack a task
    assert objective(task_weights={"Hark": 2.0}).token_labels(synthetic_split(False, "val")) is not None


def test_task_weights_must_be_non_negative_and_at_most_127():
    with pytest.raises(ValueError, match=">= 0"):
        Distill.Options(task_weights={"a": -1.0})
    with pytest.raises(ValueError, match="127"):
        Distill.Options(task_weights={f"task {i}": 1.0 for i in range(128)})
    assert len(Distill.Options(task_weights={f"task {i}": 1.0 for i in range(127)}).task_weights) == 127


def test_the_training_loss_is_the_hand_weighted_mean_and_evaluation_is_unweighted():
    g = torch.Generator().manual_seed(0)
    prefixes = {SPEAKER: 4.0, NEXT: 0.5}
    split = synthetic_split(with_mask=True)
    o = objective(task_weights=prefixes, temperature=2.0, alpha=0.3)
    label = o.token_labels(split)
    positions = np.stack([np.arange(0, 40), np.arange(60, 100)])  # rows crossing document boundaries
    tokens = torch.from_numpy(split.tokens[positions].astype(np.int64))
    windows = Windows(tokens, labels=torch.from_numpy(label(positions)))
    batch = o.make_batch_from(windows)
    B, T = batch.targets.shape
    vocab = len(split.tokenizer.alphabet)
    student, teacher = torch.randn(B, T, vocab, generator=g) * 2, torch.randn(B, T, vocab, generator=g) * 2
    o.prepare(ObjectiveContext(runs={"teacher": TrainedRun(Path("t"), {}, None, Fixed(teacher))},
                               tokenizer=None, generate=None))
    # the weight of each target, by hand: the task of the document the target token belongs to
    weight_of = {SPEAKER: 4.0, NEXT: 0.5}
    doc = np.searchsorted(split.document_starts, positions[:, 1:], side="right") - 1
    hand_weights = np.vectorize(lambda d: weight_of.get(DOCUMENT_TASKS[d], 1.0))(doc).reshape(-1)
    targets = batch.targets.reshape(-1).tolist()
    scored = np.array(targets) != IGNORE_INDEX
    assert scored.sum() > 10 and set(hand_weights[scored]) == {1.0, 4.0, 0.5}  # every kind of weight is scored
    s, t = student.reshape(-1, vocab).tolist(), teacher.reshape(-1, vocab).tolist()
    model = Fixed(student)
    model.train()
    weighted = o.forward_loss(model, batch).item()
    assert weighted == pytest.approx(by_hand(s, t, targets, 2.0, 0.3, hand_weights.tolist()), rel=1e-5)
    model.eval()
    unweighted = o.forward_loss(model, batch).item()
    assert unweighted == pytest.approx(by_hand(s, t, targets, 2.0, 0.3), rel=1e-5)
    assert weighted != pytest.approx(unweighted, rel=1e-3)


# -- refusals ---------------------------------------------------------------------------------------------

def test_a_missing_teacher_is_refused_naming_objective_teacher():
    with pytest.raises(UserError) as info:
        Distill().check(SimpleNamespace(shape=SimpleNamespace(block_size=8)))
    assert info.value.key == "objective.teacher"
    objective().check(SimpleNamespace(shape=SimpleNamespace(block_size=8)))


@pytest.mark.parametrize("name, ok", [("causal-lm", True), ("sft", True), ("distill", True), ("dpo", True),
                                      ("mlm", False), ("reward-model", False)])
def test_only_next_token_language_models_can_teach(name, ok):
    runs = {"teacher": TrainedRun(Path("runs/t"), {"objective": {"use": name}}, None)}
    if ok:
        objective().check_runs(runs)
        return
    with pytest.raises(UserError, match="bidirectional" if name == "mlm" else "next token") as info:
        objective().check_runs(runs)
    assert info.value.key == "objective.teacher"


def test_a_teacher_with_another_vocabulary_size_or_a_shorter_context_is_refused():
    from lmlab.api import Vocabulary

    def prepare(teacher, block_size=8):
        o = objective()
        o.check(SimpleNamespace(shape=SimpleNamespace(block_size=block_size)))
        o.setup(Vocabulary(size=V, tokenizer_size=V))
        o.prepare(ObjectiveContext(runs={"teacher": TrainedRun(Path("t"), {}, None, teacher)}, tokenizer=None,
                                   generate=None))
        return o

    logits = torch.zeros(1, 8, V)
    assert prepare(Fixed(logits, max_context=8)).teacher is not None
    assert prepare(Fixed(logits, max_context=None)).teacher is not None  # a position scheme without a limit
    for teacher, what in [(Fixed(logits, vocab_size=V + 3), "vocabulary"), (Fixed(logits, max_context=4), "4 tokens")]:
        with pytest.raises(UserError, match=what) as info:
            prepare(teacher)
        assert info.value.key == "objective.teacher"


# -- end to end -------------------------------------------------------------------------------------------

def cli(*args, cache: Path, cwd: Path):
    return subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "LMLAB_CACHE": str(cache),
                               "WANDB_MODE": "offline"})


def manifest(name: str, data: Path, *, tokenizer: str = "char", width: int = 32, steps: int = 30,
             objective_table: str = "") -> str:
    return f"""
name = "{name}"
seed = 1
[data]
use = "text-file"
path = "{data}"
[tokenizer]
use = "{tokenizer}"
[model]
n_layers = 1
n_heads = 2
d_model = {width}
block_size = 32
[optimizer]
use = "adamw"
lr = 3e-3
[train]
max_steps = {steps}
batch_size = 8
warmup_steps = 5
eval_every = {steps}
checkpoint_every = {steps}
eval_steps = 2
sample_tokens = 0
[tracker]
use = "none"
{objective_table}
"""


def refused(result, key: str) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"lmlab: error: {key}:"), result.stderr
    return errors[0]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(work folder, its 40 kB corpus, a trained teacher run folder), shared by the end-to-end tests."""
    work = tmp_path_factory.mktemp("distill")
    corpus = work / "corpus.txt"
    corpus.write_text(CORPUS.read_text()[:40_000])
    (work / "teacher.toml").write_text(manifest("teacher", corpus, width=48, steps=60))
    result = cli("run", "teacher.toml", "--out", "runs/teacher", cache=work / "cache", cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    return work, corpus, work / "runs" / "teacher" / "default"


def test_a_student_distils_from_a_teacher_run_through_the_cli(teacher_run):
    work, corpus, teacher = teacher_run
    table = f'[objective]\nuse = "distill"\nteacher = "{teacher}"\ntemperature = 2.0\nalpha = 0.7\n'
    (work / "student.toml").write_text(manifest("student", corpus, width=16, steps=20, objective_table=table))
    result = cli("run", "student.toml", "--out", "runs/student", cache=work / "cache", cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((work / "runs" / "student" / "default" / "summary.json").read_text())
    assert summary["status"] == "completed"
    soft, hard = summary["val_soft_loss"], summary["val_hard_loss"]
    # plain text: every token scored, evaluation unweighted, so val_loss is exactly the mix of the two
    assert summary["val_loss"] == pytest.approx(0.7 * soft + 0.3 * hard, rel=1e-5)
    assert 0 < soft < hard
    # the teacher's own held-out loss, on the same windows of the same split: its trained weights were used
    theirs = json.loads((teacher / "summary.json").read_text())
    assert summary["val_teacher_hard_loss"] == pytest.approx(theirs["val_loss"], rel=1e-4)
    assert summary["val_teacher_hard_loss"] < hard


def test_a_teacher_with_another_tokenizer_is_refused_by_lmlab_check_naming_objective_teacher(teacher_run):
    work, corpus, teacher = teacher_run
    table = f'[objective]\nuse = "distill"\nteacher = "{teacher}"\n'
    # A byte tokenizer knows its ids before the data: `lmlab check` compares them with the char teacher's.
    (work / "bytes.toml").write_text(manifest("bytes", corpus, tokenizer="byte", objective_table=table))
    line = refused(cli("check", "bytes.toml", cache=work / "cache", cwd=work), "objective.teacher")
    assert "different tokenizer" in line


@pytest.fixture(scope="module")
def other_charset(teacher_run) -> Path:
    """A student manifest whose teacher is a char run fitted on a text with other characters."""
    work, corpus, _ = teacher_run
    other = work / "other.txt"
    other.write_text("\n".join("abc cab bead" for _ in range(2000)))
    (work / "other.toml").write_text(manifest("other", other, tokenizer="char", steps=1))
    result = cli("run", "other.toml", "--out", "runs/other", cache=work / "cache", cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    table = f'[objective]\nuse = "distill"\nteacher = "{work / "runs" / "other" / "default"}"\n'
    (work / "student-other.toml").write_text(manifest("student-other", corpus, objective_table=table))
    return work / "student-other.toml"


@pytest.mark.slow  # two more runs, about 10 s
def test_a_char_teacher_fitted_on_other_characters_stops_the_run_before_a_step(other_charset):
    work = other_charset.parent
    line = refused(cli("run", other_charset.name, "--out", "runs/so", cache=work / "cache", cwd=work),
                   "objective.teacher")
    assert "different tokenizer" in line and not (work / "runs" / "so" / "default" / "metrics.jsonl").exists()


def test_a_manifest_without_a_teacher_is_refused_by_lmlab_check(teacher_run):
    work, corpus, _ = teacher_run
    (work / "none.toml").write_text(manifest("none", corpus, objective_table='[objective]\nuse = "distill"\n'))
    refused(cli("check", "none.toml", cache=work / "cache", cwd=work), "objective.teacher")
