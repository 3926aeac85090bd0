"""The conformance kit's decoding and objective checks: a small correct plugin of each slot passes, and
plugins broken in one specific way each fail, with a message naming the check that saw it. (The
first-party decoders and objectives are checked in their own distributions' tests.)"""

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import (IGNORE_INDEX, Batch, Decoder, DecodingOptions, Field, Objective, Options, Stepper,
                       TokenDecoder, UserError)
from lmlab.testing import ConformanceError
from lmlab.testing.common import select_checks
from lmlab.testing.decoding import CHECKS as DECODING_CHECKS
from lmlab.testing.decoding import DecodingSubject, check_decoding
from lmlab.testing.objective import CHECKS as OBJECTIVE_CHECKS
from lmlab.testing.objective import ObjectiveSubject, check_objective


def failures(checks, subject) -> dict[str, str]:
    """check name → message, for every check the subject's plugin fails."""
    found = {}
    for check in select_checks(checks, subject):
        try:
            check()
        except ConformanceError as exc:
            found[check.name] = str(exc)
    return found


# -- decoders ---------------------------------------------------------------------------------------

class TinyTokenOptions(DecodingOptions):
    top_k: int | None = Field(None, ge=1, help="sample among the k most likely tokens (unset: all)")


class TinyOptions(Options):
    top_k: int | None = Field(None, ge=1, help="sample among the k most likely tokens (unset: all)")


class Tiny(Decoder):
    """Top-k sampling through lmlab.api.Stepper, padding finished rows with eos_id: correct."""

    name = "tiny"
    Options = TinyOptions

    def choose(self, logits, generator, prompt):
        k = self.options.top_k or logits.shape[-1]
        kth = logits.topk(k, dim=-1).values[:, -1:]
        return torch.multinomial(logits.masked_fill(logits < kth, float("-inf")).softmax(-1), 1,
                                 generator=generator)[:, 0]

    def steps(self, max_new_tokens):
        return max_new_tokens

    def generate(self, model, prompt, max_new_tokens, eos_id=None, generator=None):
        if max_new_tokens <= 0:
            return prompt
        stepper = Stepper(model, prompt.shape[0], prompt.shape[1] + max_new_tokens)
        logits, new = stepper.start(prompt), []
        finished = torch.zeros(prompt.shape[0], dtype=torch.bool)
        for i in range(self.steps(max_new_tokens)):
            token = self.choose(logits.float(), generator, prompt)
            if eos_id is not None:
                token = self.after_eos(token, finished, eos_id)
                finished |= token == eos_id
            new.append(token)
            if i == max_new_tokens - 1 or self.stops(finished, eos_id):
                break
            logits = stepper.step(token)
        return torch.cat([prompt, torch.stack(new, dim=1)], dim=1)

    def after_eos(self, token, finished, eos_id):
        return token.masked_fill(finished, eos_id)

    def stops(self, finished, eos_id):
        return eos_id is not None and bool(finished.all())


def broken_decoder(name: str, **overrides):
    return type(name.title().replace("-", ""), (Tiny,), {"name": name, **overrides})


def unwindowed_generate(self, model, prompt, max_new_tokens, eos_id=None, generator=None):
    out = prompt
    for _ in range(max_new_tokens):  # the whole text every step: past block_size the model refuses it
        out = torch.cat([out, model(out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


def in_place_generate(self, model, prompt, max_new_tokens, eos_id=None, generator=None):
    out = Tiny.generate(self, model, prompt, max_new_tokens, eos_id, generator)
    prompt[:, 0] = 0
    return out


BROKEN_DECODERS = [
    (broken_decoder("runner-up", choose=lambda self, logits, g, p: logits.topk(2, dim=-1).indices[:, 1]),
     "greedy_equivalence", "but token"),
    (broken_decoder("global-draws", choose=lambda self, logits, g, p: torch.multinomial(logits.softmax(-1), 1)[:, 0]),
     "determinism", "draws from torch's global random state"),
    (broken_decoder("global-draws", choose=lambda self, logits, g, p: torch.multinomial(logits.softmax(-1), 1)[:, 0]),
     "global_rng", "changed torch's global random state"),
    (broken_decoder("one-short", steps=lambda self, n: n - 1 if n > 1 else n), "max_new_tokens",
     "max_new_tokens=19, eos_id=None) returned shape (2, 22), expected (2, 23)"),
    (broken_decoder("unwindowed", generate=unwindowed_generate), "max_new_tokens",
     "raised ValueError: positions up to 16 requested"),
    (broken_decoder("in-place", generate=in_place_generate), "max_new_tokens", "changed the prompt tensor in place"),
    (broken_decoder("deaf", stops=lambda self, finished, eos_id: False), "eos",
     "the output has 10 new tokens, expected 6"),
    (broken_decoder("unpadded", after_eos=lambda self, token, finished, eos_id: token), "eos",
     "row 0 continues"),
    (broken_decoder("crowd", choose=lambda self, logits, g, p: (logits + logits.mean(0)).argmax(-1)),
     "batch_independence", "of a batch of 4 prompts continues"),
]


class TokenTopK(TokenDecoder):
    """Top-k sampling as a TokenDecoder (API 1.17): each row with its own top_k and generator; correct."""

    name = "token-top-k"
    Options = TinyTokenOptions

    def choose(self, logits, rows):
        k = rows.values("top_k", logits.shape[-1], torch.long)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        return rows.sample(logits.masked_fill(logits < kth, float("-inf")).softmax(-1))


class SelfReading(TokenTopK):
    """Reads the decoder's own options, so lmlab serve's requests could not set top_k: broken."""

    name = "self-reading"

    def choose(self, logits, rows):
        k = self.options.top_k or logits.shape[-1]
        kth = logits.topk(k, dim=-1).values[:, -1:]
        return rows.sample(logits.masked_fill(logits < kth, float("-inf")).softmax(-1))


def test_a_token_decoder_must_choose_each_row_with_that_rows_options():
    check_decoding(TokenTopK)
    found = failures(DECODING_CHECKS, DecodingSubject(SelfReading))
    assert list(found) == ["per_row_options"] and "did not choose the argmax" in found["per_row_options"], found


@pytest.mark.parametrize("options", [None, {"top_k": 1}, {"top_k": 3}])
def test_a_correct_small_decoder_passes_and_leaves_the_callers_random_state_alone(options):
    rng = torch.get_rng_state()
    check_decoding(Tiny, options)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("plugin, check, observed", BROKEN_DECODERS,
                         ids=[f"{p.name}-{c}" for p, c, _ in BROKEN_DECODERS])
def test_a_broken_decoder_fails_the_check_that_observes_its_bug(plugin, check, observed):
    found = failures(DECODING_CHECKS, DecodingSubject(plugin))
    assert check in found, found
    assert found[check].startswith(f"{plugin.name}: {check}: ") and observed in found[check], found[check]
    with pytest.raises(ConformanceError, match=f"(?m)^{plugin.name}: {check}: "):
        check_decoding(plugin)


class Width(Options):
    width: int = Field(3, ge=1, help="beam width")


class WideTiny(Tiny):
    """Greedy when width is 1, random otherwise: an option the kit cannot know makes it greedy."""

    name = "wide"
    Options = Width

    def choose(self, logits, generator, prompt):
        if self.options.width == 1:
            return logits.argmax(-1)
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def test_a_decoder_greedy_under_an_option_of_its_own_names_it():
    found = failures(DECODING_CHECKS, DecodingSubject(WideTiny))
    assert set(found) == {"greedy_equivalence"}, found
    assert "pass greedy={...}" in found["greedy_equivalence"]
    check_decoding(WideTiny, greedy={"width": 1})
    check_decoding(WideTiny, skip=["greedy_equivalence"])
    with pytest.raises(ValueError, match="no check named greedy"):
        check_decoding(WideTiny, skip=["greedy"])


# -- objectives -------------------------------------------------------------------------------------

class NextToken(Objective):
    """Causal LM: the base make_batch and the mean cross-entropy: correct."""

    name = "next"

    def loss(self, logits, batch):
        return F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX)


class Masked(Objective):
    """A small masked LM: 30 % of positions chosen, half of them [MASK], half random tokens: correct."""

    name = "masked"
    causal = False
    special_tokens = ("mask",)

    def setup(self, vocab):
        self.mask_id, self.high = vocab.special["mask"], vocab.tokenizer_size

    def draws(self, windows, T):
        return windows.rand(T), windows.rand(T), windows.randint(self.high, T)

    def make_batch_from(self, windows):
        tokens = windows.tokens[:, :-1]
        chosen, action, random = self.draws(windows, tokens.shape[1])
        chosen = chosen < 0.3
        inputs = torch.where(chosen & (action < 0.5), self.mask_id, torch.where(chosen, random, tokens))
        return Batch(inputs, tokens.masked_fill(~chosen, IGNORE_INDEX))

    loss = NextToken.loss


class Responses(Objective):
    """SFT: one record per row, scoring the response tokens (loss_mask) only: correct."""

    name = "responses"
    sampling = "documents"

    def token_labels(self, split):
        if split.loss_mask is None:
            raise UserError("no loss mask", key="objective.use")
        return lambda positions: split.loss_mask[positions]

    def scored(self, windows):
        return windows.labels[:, 1:].bool() & ~windows.padding[:, 1:]

    def make_batch_from(self, windows):
        return Batch(windows.tokens[:, :-1], windows.tokens[:, 1:].masked_fill(~self.scored(windows), IGNORE_INDEX))

    loss = NextToken.loss


def broken_objective(base, name: str, **overrides):
    return type(name.title().replace("-", ""), (base,), {"name": name, **overrides})


def whole_vocabulary(self, vocab):
    self.mask_id, self.high = vocab.special["mask"], vocab.size


def global_draws(self, windows, T):
    B = windows.tokens.shape[0]
    return torch.rand(B, T), torch.rand(B, T), torch.randint(0, self.high, (B, T))


def own_stream(self, windows, T):
    B, g = windows.tokens.shape[0], windows.generator  # the whole stream for this replica's rows alone
    return (torch.rand(B, T, generator=g), torch.rand(B, T, generator=g),
            torch.randint(0, self.high, (B, T), generator=g))


def labels_of_the_input(self, windows):
    return windows.labels[:, :-1].bool() & ~windows.padding[:, 1:]


def wrong_labels(self, split):
    return lambda positions: positions[:, :1]


BROKEN_OBJECTIVES = [
    (broken_objective(NextToken, "copy", make_batch=lambda self, w: Batch(w[:, :-1], w[:, :-1])), "causal",
     "of the scored targets t equal input_ids[t + 0]"),
    (broken_objective(NextToken, "peeking", causal=False), "causal",
     "equal input_ids[t + 1], which the model sees, attending bidirectionally"),
    (broken_objective(NextToken, "summed", loss=lambda self, logits, batch: F.cross_entropy(
        logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")), "loss",
     "differs from the mean cross-entropy of the batch's scored targets"),
    (broken_objective(Masked, "unmasked", loss=lambda self, logits, batch: F.cross_entropy(
        logits.flatten(0, 1), torch.where(batch.targets < 0, batch.input_ids, batch.targets).flatten())),
     "ignore_index", "whose ignored (IGNORE_INDEX) target moves the loss"),
    (broken_objective(Masked, "hard-coded", setup=lambda self, vocab: setattr(self, "mask_id", vocab.tokenizer_size)
                      or setattr(self, "high", vocab.tokenizer_size)), "special_tokens",
     "with the tokenizer's own special ids {'mask': 1}, tokenizer_size 19, size 37: input ids [19] are neither"),
    (broken_objective(Masked, "everyone", setup=whole_vocabulary), "special_tokens",
     "are neither tokenizer ids nor special ids from setup"),
    (broken_objective(Masked, "global-draws", draws=global_draws), "determinism",
     "drew from torch's global random state"),
    (broken_objective(Masked, "own-stream", draws=own_stream), "replica_slices",
     "give other input_ids than rows 2..3 of the global batch"),
    (broken_objective(Responses, "early", scored=labels_of_the_input), "prompt_mask",
     "has loss_mask 1 (a response token) but is not scored"),
    (broken_objective(Responses, "padded", scored=lambda self, w: torch.ones_like(w.padding[:, 1:])), "padding",
     "changed the targets: padding is scored"),
    (broken_objective(Responses, "windowless", make_batch_from=Objective.make_batch_from), "declarations",
     "sampling is 'documents' but make_batch_from is not overridden"),
    (broken_objective(Responses, "sloppy", token_labels=wrong_labels), "token_labels",
     "maps positions (2, 5) to int64 (2, 1)"),
]

# Difficulty (API 1.10, [order] use = "difficulty"): a score per document, from the document alone.


def document_lengths(split):
    return np.diff(np.append(split.document_starts, len(split.tokens))).astype(np.float64)


class Scored(NextToken):
    """Longer documents are harder: correct."""

    name = "scored"

    def difficulty(self, split):
        return document_lengths(split)


BROKEN_OBJECTIVES += [
    (broken_objective(Scored, "by-rank", difficulty=lambda self, split: np.arange(
        len(split.document_starts), dtype=np.float64)), "difficulty", "when given the documents in another order"),
    (broken_objective(Scored, "relative", difficulty=lambda self, split: document_lengths(split)
                      / document_lengths(split).max()), "difficulty", "when given the documents half of them"),
    (broken_objective(Scored, "empty-is-nan", difficulty=lambda self, split: np.where(
        document_lengths(split) > 10, document_lengths(split), np.nan)), "difficulty", "every score must be finite"),
    (broken_objective(Scored, "noisy", difficulty=lambda self, split: document_lengths(split)
                      + torch.rand(len(split.document_starts)).numpy()), "difficulty",
     "drew from torch's global random state"),
    (broken_objective(Scored, "per-token", difficulty=lambda self, split: np.ones(len(split.tokens))), "difficulty",
     "must be a numeric numpy array of shape (n_documents,)"),
]


@pytest.mark.parametrize("plugin", [NextToken, Masked, Responses, Scored], ids=lambda p: p.name)
def test_a_correct_small_objective_passes_and_leaves_the_callers_random_state_alone(plugin):
    rng = torch.get_rng_state()
    check_objective(plugin)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("plugin, check, observed", BROKEN_OBJECTIVES,
                         ids=[f"{p.name}-{c}" for p, c, _ in BROKEN_OBJECTIVES])
def test_a_broken_objective_fails_the_check_that_observes_its_bug(plugin, check, observed):
    found = failures(OBJECTIVE_CHECKS, ObjectiveSubject(plugin))
    assert check in found, found
    assert found[check].startswith(f"{plugin.name}: {check}: ") and observed in found[check], found[check]
    with pytest.raises(ConformanceError, match=f"(?m)^{plugin.name}: {check}: "):
        check_objective(plugin)


def test_an_objective_whose_loss_is_not_the_cross_entropy_says_so():
    z_loss = broken_objective(NextToken, "z", loss=lambda self, logits, batch: NextToken.loss(self, logits, batch)
                              + 1e-2 * torch.logsumexp(logits.float(), -1).square().mean())
    with pytest.raises(ConformanceError, match="^z: loss: .*pass cross_entropy=False"):
        check_objective(z_loss)
    check_objective(z_loss, cross_entropy=False)
    ascending = broken_objective(NextToken, "ascending", loss=lambda self, logits, batch: -NextToken.loss(
        self, logits, batch))
    with pytest.raises(ConformanceError, match="^ascending: loss: raising the logits of the scored targets by 5 moved "
                                               "the loss from .* not lower"):
        check_objective(ascending, cross_entropy=False)


# -- objectives that run the model (API 1.10) -------------------------------------------------------

class ValueHead(nn.Linear):
    """d_model → 1, initialised from torch's (seeded) global generator."""

    def __init__(self, d_model):
        super().__init__(d_model, 1)


class AnchoredOptions(Options):
    reference: Path | None = Field(None, help="the frozen reference run folder")


class Anchored(Objective):
    """Runs the model itself: the responses' cross-entropy through the model's head, a squared pull of
    each token's loss towards a frozen reference's, and a value head regressing the loss: correct."""

    name = "anchored"
    api = ">=1.10,<2"  # forward_loss, heads, needs_runs, prepare, report
    Options = AnchoredOptions
    sampling = "documents"
    needs_runs = ("reference",)
    head = ValueHead
    figure = "gap"
    pull = 0.1
    frozen = staticmethod(torch.no_grad)  # how the reference is run

    token_labels, make_batch_from, scored = Responses.token_labels, Responses.make_batch_from, Responses.scored

    def heads(self, shape):
        return {"value": self.head(shape.d_model)}

    def prepare(self, context):
        self.reference = context.runs["reference"].model

    def token_losses(self, logits, batch):
        return F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="none").view(batch.targets.shape)

    def forward_loss(self, model, batch):
        hidden = model(batch.input_ids, hidden=True)
        nll = self.token_losses(model.head(hidden), batch)
        with self.frozen():
            reference = self.token_losses(self.reference(batch.input_ids), batch)
        scored = (batch.targets != IGNORE_INDEX).float()
        n = scored.sum().clamp(min=1)
        value = model.heads["value"](hidden).squeeze(-1).float()
        value_loss = ((value - nll.detach()).square() * scored).sum() / n
        self.report(self.figure, (nll - reference).detach()[scored.bool()])
        return (nll * scored).sum() / n + self.pull * ((nll - reference).square() * scored).sum() / n \
            + 0.1 * value_loss


class UnseededHead(ValueHead):
    def reset_parameters(self):
        generator = torch.Generator()
        generator.seed()  # a fresh seed from the OS: not torch's seeded global generator
        with torch.no_grad():
            self.weight.normal_(0.0, 0.02, generator=generator)
            self.bias.zero_()


def thaw(self, context):
    self.reference = context.runs["reference"].model.requires_grad_(True)


class Counting(Anchored):
    def forward_loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        return Anchored.forward_loss(self, model, batch) + 1e-2 * self.calls


def drifting(self, model, batch):
    with torch.no_grad():
        for p in self.reference.parameters():
            p.mul_(0.99)
    return Anchored.forward_loss(self, model, batch)


def nan_figure(self, model, batch):
    self.report("gap", torch.full((3,), float("nan")))
    return Anchored.forward_loss(self, model, batch)


BROKEN_MODEL_RUNNERS = [
    (broken_objective(Anchored, "detached", forward_loss=lambda self, model, batch: Anchored.forward_loss(
        self, model, batch).detach()), "loss", "has no gradient"),
    (broken_objective(Anchored, "sleepy", forward_loss=lambda self, model, batch: Anchored.forward_loss(
        self, model.eval(), batch)), "loss", "left the model in eval mode"),
    (broken_objective(Counting, "counting"), "loss", "in eval mode the same batch gave the loss"),
    (broken_objective(Anchored, "thawing", prepare=thaw, frozen=staticmethod(contextlib.nullcontext)), "runs",
     "parameters of the frozen run 'reference' require or received a gradient"),
    (broken_objective(Anchored, "training", prepare=lambda self, context: setattr(
        self, "reference", context.runs["reference"].model.train())), "runs", "was put in training mode"),
    (broken_objective(Anchored, "drifting", forward_loss=drifting), "runs",
     "the weights of the frozen run 'reference' changed"),
    (broken_objective(Anchored, "unanchored", pull=0.0), "runs", "does not use the run it asks for"),
    (broken_objective(Anchored, "undeclared", needs_runs=("teacher",)), "declarations",
     "needs_runs must be a tuple of names of the objective's options"),
    (broken_objective(Anchored, "shouty", figure="Gap"), "reports", "reports 'Gap'"),
    (broken_objective(Anchored, "nan", forward_loss=nan_figure), "reports", "figure 'gap' sums to nan"),
    (broken_objective(Anchored, "unseeded", head=UnseededHead), "heads",
     "reset_parameters under the same seed gave weight other values"),
    (broken_objective(Anchored, "padded-anchor", scored=lambda self, w: torch.ones_like(w.padding[:, 1:])),
     "padding", "changed the targets: padding is scored"),
]


@pytest.mark.parametrize("corpus", ["segments", "preferences"])
def test_a_correct_objective_that_runs_the_model_passes_and_leaves_the_callers_random_state_alone(corpus):
    rng = torch.get_rng_state()
    check_objective(Anchored, corpus=corpus)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("plugin, check, observed", BROKEN_MODEL_RUNNERS,
                         ids=[f"{p.name}-{c}" for p, c, _ in BROKEN_MODEL_RUNNERS])
def test_a_broken_objective_that_runs_the_model_fails_the_check_that_observes_its_bug(plugin, check, observed):
    found = failures(OBJECTIVE_CHECKS, ObjectiveSubject(plugin))
    assert check in found, found
    assert found[check].startswith(f"{plugin.name}: {check}: ") and observed in found[check], found[check]
    with pytest.raises(ConformanceError, match=f"(?m)^{plugin.name}: {check}: "):
        check_objective(plugin)


def test_runs_are_given_the_heads_and_name_of_the_objective_that_trained_them():
    class Picky(Anchored):
        name = "picky"

        def check_runs(self, runs):
            if runs["reference"].objective != "anchored":
                raise UserError("the reference must be an anchored run", key="objective.reference")

    with pytest.raises(ConformanceError, match="^picky: runs: check_runs refused the kit's runs, trained .* with "
                                               r"\{'reference': 'picky'\}: objective.reference: .*\Z"):
        check_objective(Picky)
    check_objective(Picky, runs={"reference": Anchored})
    with pytest.raises(ValueError, match="runs names \\['teacher'\\], not in Picky.needs_runs"):
        check_objective(Picky, runs={"teacher": Anchored})
    with pytest.raises(ValueError, match="corpus must be"):
        check_objective(Picky, corpus="pairs")


def test_the_preference_corpus_has_whole_records_and_a_cut_one_in_the_first_batch():
    for seed in range(5):
        subject = ObjectiveSubject(Anchored, corpus="preferences", seed=seed)
        split = subject.split(subject.vocabulary())
        ends = np.append(split.document_starts[1:], len(split.tokens))
        for start, end in zip(split.document_starts, ends):
            assert set(split.loss_mask[start:end].tolist()) == {0, 1, 2}
            assert split.loss_mask[start:end].tolist() == sorted(split.loss_mask[start:end].tolist())
        windows = subject.draw(subject.objective(subject.vocabulary()), split)
        assert windows.padding[:, -1].tolist() == [True, True, False, True]
