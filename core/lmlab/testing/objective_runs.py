"""The objective checks of the loss (:mod:`lmlab.testing.objective` has those of the batch), for objectives
scoring logits and for those that run the model themselves (API 1.10), and what the kit gives the latter.

An objective that overrides ``forward_loss`` gets the kit's model (built with its ``heads``) and, for
each option of ``needs_runs``, a :class:`~lmlab.api.runs.TrainedRun` whose model is a frozen kit model
(other weights than the trained one's) with the heads of the objective that run trained (setting
``runs={option: objective name}``; by default the subject's own), handed over as the core does:
``check_runs`` without models, then with them, then ``prepare``. Its rollouts decode greedily
(:class:`KitGreedy`). Pair objectives read the ``"preferences"`` corpus (:func:`preference_documents`).
"""

import dataclasses
import math
from functools import partial
from pathlib import Path

import numpy as np
import torch

from lmlab.api import IGNORE_INDEX, Decoder, Objective, UserError
from lmlab.api.objective import RESERVED_REPORTS
from lmlab.api.runs import ObjectiveContext, TrainedRun
from lmlab.testing.common import DEPENDENT, SAME, fail, reloaded

PROMPT, CHOSEN, REJECTED = 0, 1, 2
LONG_ROW = 2  # the row of the kit's first batch whose record does not fit (rows 2..3 are a replica's)


class KitGreedy(Decoder):
    """The most likely token at every step: the kit's ``ObjectiveContext.generate`` decodes with it, so a
    rollout is the same whatever the generator (a run's ``[decoding]`` plugin may sample)."""

    name = "kit-greedy"

    def decode(self, engine, prompts, outputs, generator=None):
        rows, logits = engine.add(prompts)
        live = list(range(len(prompts)))  # prompt indices, in the order of the logits' rows
        while True:
            tokens = logits.argmax(dim=-1)
            yield {i: [t] for i, t in zip(live, tokens.tolist())}
            keep = [j for j, i in enumerate(live) if not outputs.done(i)]
            if len(keep) < len(live):
                engine.release([rows[i] for i in live if outputs.done(i)])
                if not keep:
                    return
                live, tokens = [live[j] for j in keep], tokens[keep]
            logits = engine.step([rows[i] for i in live], tokens[:, None])[:, -1]


def preference_documents(rng, ids: np.ndarray, block_size: int, rows: int, seed: int):
    """(tokens, document starts, loss mask) of the preferences corpus: the ids of ``ids`` in turn, each
    document a prompt (loss_mask 0), a chosen answer (1) and a rejected one (2), all non-empty. In the
    first batch of ``rows`` documents the core's sampler draws at ``seed``, every record fits its row
    (≤ block_size tokens, so padding follows) but row :data:`LONG_ROW`'s, whose end is cut off; a
    quarter of the other documents are long too (block_size + 2 to 2·block_size tokens)."""
    from lmlab.train.batches import RandomDocuments

    n = max(4 * rows, 40 * block_size // 12)
    lengths = rng.integers(3, block_size + 1, size=n)
    long = rng.random(n) < 0.25
    # The sampler's order depends only on the number of documents: which are drawn is known before
    # their lengths, so both kinds of record reach the first batch whatever the seed.
    drawn = RandomDocuments(np.zeros(n), np.arange(n), block_size, rows, seed).documents(0)
    long[drawn] = False
    long[drawn[min(LONG_ROW, rows - 1)]] = True
    lengths[long] = rng.integers(block_size + 2, 2 * block_size + 1, size=int(long.sum()))
    masks = []
    for m in lengths.tolist():
        prompt = max(1, m // 3)
        chosen = max(1, (m - prompt) // 2)
        masks += [PROMPT] * prompt + [CHOSEN] * chosen + [REJECTED] * (m - prompt - chosen)
    total, starts = int(lengths.sum()), np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return np.tile(ids, total // len(ids) + 1)[:total], starts, np.array(masks, dtype=np.uint8)


# -- the runs an objective is given ------------------------------------------------------------------

def resolve_runs(cls, runs) -> dict:
    """The subject's ``runs`` setting (option → an objective's name, class or instance), checked against
    the plugin's ``needs_runs``; names are looked up among the installed objectives."""
    from lmlab import discovery

    if unknown := set(runs or {}) - set(getattr(cls, "needs_runs", ())):
        raise ValueError(f"runs names {sorted(unknown)}, not in {cls.__name__}.needs_runs {cls.needs_runs}")
    return {option: discovery.load("objective", value) if isinstance(value, str) else value
            for option, value in (runs or {}).items()}


def kit_runs(subject, objective: Objective, vocab) -> dict[str, TrainedRun]:
    """Option → TrainedRun for each of ``objective.needs_runs``, as the core reads them, each with a frozen
    kit model (eval mode, no parameter requiring a gradient) with the heads of the objective its run
    trained, built under a seed of its own."""
    found = {}
    for i, option in enumerate(getattr(objective, "needs_runs", ())):
        trained = subject.runs.get(option)
        if trained is None:
            other, name = objective, subject.name
        else:
            other = trained if isinstance(trained, Objective) else trained()
            other.setup(vocab)
            name = getattr(trained, "name", "") or type(other).__name__
        model = subject.model(other, seed=subject.seed + 101 + i).requires_grad_(False)
        found[option] = TrainedRun(path=Path("kit-runs") / option, manifest={"objective": {"use": name}},
                                   tokenizer=subject.tokenizer(vocab), model=model)
    return found


def hand_over(subject, objective: Objective, vocab, runs=None, strict: bool = False) -> dict[str, TrainedRun]:
    """What the core does before the first batch: ``check_runs`` on the runs without their models (``lmlab
    check``), again with them, then ``prepare``; returns the runs given (``runs``, else the kit's). A
    refusal fails only when ``strict`` (the ``runs`` check): the other checks go on to ``prepare``."""
    from lmlab.generation.batch import generate_ids

    if runs is None:
        runs = kit_runs(subject, objective, vocab)
    try:
        if runs:
            objective.check_runs({k: TrainedRun(r.path, r.manifest, r.tokenizer) for k, r in runs.items()})
            objective.check_runs(runs)
    except UserError as exc:
        trained = {k: r.objective for k, r in runs.items()}
        if strict:
            fail(f"check_runs refused the kit's runs, trained (as the kit says) with {trained}: {exc}; give the "
                 "objective each run trained with the setting runs={option: objective name}")
    tokenizer = subject.tokenizer(vocab)
    generate = partial(generate_ids, KitGreedy(), eos_id=tokenizer.eos_id)
    objective.prepare(ObjectiveContext(runs=runs, tokenizer=tokenizer, generate=generate, init=None))
    return runs


# -- checks --------------------------------------------------------------------------------------------

def scalar(value, what: str, grad: bool) -> float:
    """``value`` as a float, if it is a finite 0-dim floating tensor (with a gradient when ``grad``)."""
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()):
        fail(f"{what} is {value!r}, not a 0-dim floating-point tensor")
    if not bool(torch.isfinite(value)):
        fail(f"{what} is {value.item()}, not finite")
    if grad and not value.requires_grad:
        fail(f"{what} has no gradient (a detached loss, or one computed under no_grad?)")
    return value.item()


def eval_loss(model, objective, batch) -> float:
    """The loss as evaluation takes it: eval mode, no gradients."""
    from lmlab.model import compute_loss

    model.eval()
    with torch.no_grad():
        return scalar(compute_loss(model, objective, batch).loss, "the loss in eval mode", grad=False)


def loss(subject) -> None:
    """Through the core's ``compute_loss`` with the reference model (bidirectional when ``causal`` is
    False): a finite floating-point scalar with a gradient. With ``cross_entropy`` (the default), equal
    within 1e-4 to the mean cross-entropy of the scored targets worked out in float64; for an objective
    with the base ``make_batch``, also to that of the logits over ``w[:, :-1]`` against ``w[:, 1:]``
    from the windows alone. Either way, raising the scored targets' logits lowers it. An objective that
    runs the model is held to ``objective_runs.model_loss`` instead."""
    from lmlab.model import compute_loss

    if subject.cls.runs_model():
        return model_loss(subject)
    objective, windows, made = subject.sample()
    model = subject.model(objective)
    value = compute_loss(model, objective, made).loss
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()
            and bool(torch.isfinite(value).all()) and value.requires_grad):
        fail(f"loss returned {value!r}, not a finite floating-point scalar tensor with a gradient")
    with torch.no_grad():
        logits = model(made.input_ids)
    references = {"the mean cross-entropy of the batch's scored targets": _cross_entropy(logits, made.targets)}
    if type(objective).make_batch is Objective.make_batch and not objective.wants_windows():
        w = windows.tokens
        references["the mean cross-entropy of the logits over w[:, :-1] against w[:, 1:]"] = \
            _cross_entropy(model(w[:, :-1]).detach(), w[:, 1:])
    if subject.cross_entropy:
        for what, expected in references.items():
            if abs(value.item() - expected) > SAME * max(1.0, abs(expected)):
                fail(f"loss {value.item():.6g} differs from {what}, {expected:.6g}: the core reports exp(val loss) "
                     "as perplexity (pass cross_entropy=False for an objective whose loss is something else)")
    scored = made.targets != IGNORE_INDEX
    boost = torch.zeros_like(logits).scatter_(-1, made.targets.clamp(min=0)[..., None], 5.0) * scored[..., None]
    with torch.no_grad():
        base, boosted = objective.loss(logits, made).item(), objective.loss(logits + boost, made).item()
    if not boosted < base:
        fail(f"raising the logits of the scored targets by 5 moved the loss from {base:.6g} to {boosted:.6g}, "
             "not lower: the loss does not score the batch's targets")


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    scored = targets != IGNORE_INDEX
    logp = logits.double().log_softmax(dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (-logp[scored].sum() / scored.sum().clamp(min=1)).item()


def ignore_index(subject) -> None:
    """The gradient of the loss (through ``compute_loss``) with respect to the logits is zero at every
    position whose target is IGNORE_INDEX (-100) and non-zero at every scored one: the loss counts
    exactly the targets its batch scores. An objective that runs the model passes: the kit has no
    logits to hand its loss (``model_loss`` checks that its gradient reaches the model)."""
    from lmlab.model import compute_loss

    if subject.cls.runs_model():
        return
    objective, _, made = subject.sample()
    model = subject.model(objective)
    with torch.no_grad():
        logits = model(made.input_ids).requires_grad_(True)
    compute_loss(model, objective, made, forward=lambda _: logits).loss.backward()
    if logits.grad is None:
        fail("the loss carries no gradient to the logits")
    moved = logits.grad.abs().amax(dim=-1) > 0                                    # (B, T)
    scored = made.targets != IGNORE_INDEX
    for mask, what in ((~scored & moved, "ignored (IGNORE_INDEX) target moves the loss"),
                       (scored & ~moved, "scored target has no effect on the loss")):
        if bool(mask.any()):
            r, t = (int(i) for i in mask.nonzero()[0])
            fail(f"the logits at row {r}, position {t}, whose {what} ({int(mask.sum())} such positions)")


def model_loss(subject) -> None:
    """For an objective that runs the model (``forward_loss``), through the core's ``compute_loss`` with
    the kit's model (its heads included): in train mode, a finite 0-dim floating-point tensor whose
    backward gives some parameter of the model a non-zero gradient and none a non-finite one, leaving
    the model in train mode. In eval mode under no_grad, a finite 0-dim float, the same for the same
    batch twice, and again after a training call (no optimizer step between): evaluation interleaves
    with training, and its loss must be a function of the model and the batch alone. (Only eval mode
    is: a training call may use state from the last, as PPO reuses a rollout for ``ppo_epochs`` steps.)"""
    from lmlab.model import compute_loss

    objective, _, made = subject.sample()
    model = subject.model(objective)
    first, again = eval_loss(model, objective, made), eval_loss(model, objective, made)
    if abs(first - again) > SAME * max(1.0, abs(first)):
        fail(f"in eval mode the same batch gave the loss {first:.6g}, then {again:.6g}: state carried between "
             "calls (evaluation must be a function of the model and the batch)")
    step = compute_loss(model.train(), objective, made)
    scalar(step.loss, "the loss in train mode", grad=True)
    step.total.backward()
    if not model.training:
        fail("forward_loss left the model in eval mode (ObjectiveContext.generate restores the mode it found)")
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if bad := [n for n, g in grads.items() if not bool(torch.isfinite(g).all())]:
        fail(f"non-finite gradients in {', '.join(bad[:4])}")
    if not any(bool(g.ne(0).any()) for g in grads.values()):
        fail("the backward of the training loss gives no parameter of the model a non-zero gradient: nothing is "
             "learnt (a detached loss, or one computed under no_grad?)")
    after = eval_loss(model, objective, made)
    if abs(first - after) > SAME * max(1.0, abs(first)):
        fail(f"in eval mode the loss was {first:.6g} before a training call and {after:.6g} after it (no optimizer "
             "step between): evaluation depends on what training left in the objective")


def model_padding(subject, objective, windows, made) -> None:
    """``padding`` for an objective that runs the model: its batch's rows need not be the Windows' rows,
    so the property that matters is checked: with other ids at padded positions, the targets, the
    count evaluation weights by (``n_scored``) and the eval-mode loss are unchanged."""
    repadded = dataclasses.replace(windows, tokens=windows.tokens.masked_fill(windows.padding, 1))
    other = subject.batch(objective, repadded)
    if not torch.equal(other.targets, made.targets):
        fail("changing the ids of padded positions (0 → 1) changed the targets: padding is scored, or decides "
             "what is")
    if int(other.n_scored()) != int(made.n_scored()):
        fail(f"changing the ids of padded positions changed n_scored() from {int(made.n_scored())} to "
             f"{int(other.n_scored())}")
    model = subject.model(objective)
    base, moved = eval_loss(model, objective, made), eval_loss(model, objective, other)
    if abs(base - moved) > SAME * max(1.0, abs(base)):
        fail(f"changing the ids of padded positions moved the eval-mode loss from {base:.6g} to {moved:.6g}: "
             "the loss reads padding")


def heads(subject) -> None:
    """``heads(shape)`` maps names (non-empty, without ".") to ``nn.Module``s. On the model built with them,
    every parameter and buffer of head ``name`` is in ``model.state_dict()`` under ``heads.<name>.``
    (a checkpoint holds it) and survives ``torch.load(weights_only=True)`` into a model built under
    another seed; and a head's ``reset_parameters`` (which the model's calls), run on weights
    overwritten with 0.5, gives them back exactly the values it gave under the same seed, and not 0.5:
    an initialisation drawn from anything but torch's seeded generator makes runs unrepeatable.
    Objectives without heads: nothing to check."""
    objective = subject.objective(subject.vocabulary())
    with subject.seeded(subject.seed):  # a head's construction draws its initial weights
        built = objective.heads(subject.shape)
    if not built:
        return
    for name, head in built.items():
        if not (isinstance(name, str) and name and "." not in name and isinstance(head, torch.nn.Module)):
            fail(f"heads() gives {name!r} a {type(head).__name__}: a head is a torch.nn.Module named by a non-empty "
                 "string without '.'")
    model = subject.model(objective)
    state = model.state_dict()
    for name, head in model.heads.items():
        if missing := [key for key in head.state_dict() if f"heads.{name}.{key}" not in state]:
            fail(f"head {name!r}'s {missing[0]} is not in the model's state_dict as heads.{name}.{missing[0]}")
    fresh = subject.model(objective, seed=subject.seed + 1)
    fresh.load_state_dict(reloaded(state))
    for key, value in fresh.state_dict().items():
        if key.startswith("heads.") and not torch.equal(value, state[key]):
            fail(f"{key} differs after a save and load")
    for name, head in model.heads.items():
        if not callable(getattr(head, "reset_parameters", None)) or not list(head.parameters()):
            continue
        with subject.seeded(subject.seed + 3):
            head.reset_parameters()
        expected = {k: v.clone() for k, v in head.state_dict().items()}
        with torch.no_grad():
            for p in head.parameters():
                p.fill_(0.5)
        with subject.seeded(subject.seed + 3):
            head.reset_parameters()
        for key, value in head.state_dict().items():
            if not torch.equal(value, expected[key]):
                fail(f"head {name!r}: reset_parameters under the same seed gave {key} other values: it draws from "
                     "something other than torch's global generator")
        if all(bool((p == 0.5).all()) for p in head.parameters()):
            fail(f"head {name!r}: reset_parameters left weights overwritten with 0.5 as they were")


def runs(subject) -> None:
    """For an objective with ``needs_runs``: ``check_runs`` accepts the kit's runs (without models, then
    with them) and ``prepare`` takes them. After a training call with its backward and an eval call,
    every frozen run's model is still in eval mode, no parameter of it requires a gradient or has
    one, and its weights are bit for bit what they were: the core froze them, and training them
    would change the reference every step. And each run matters: with its model replaced by one of
    other (strongly perturbed) weights, the loss of a fresh objective moves, in train or eval mode
    (an objective may use a run in training only). Others: nothing to check."""
    from lmlab.model import compute_loss

    if not getattr(subject.cls, "needs_runs", ()):
        return
    vocab = subject.vocabulary()
    objective, given = subject.prepared(vocab, strict=True)
    made = subject.batch(objective, windows := subject.draw(objective, subject.split(vocab)))
    before = {k: {n: v.clone() for n, v in r.model.state_dict().items()} for k, r in given.items()}
    model = subject.model(objective)
    compute_loss(model.train(), objective, made).total.backward()
    eval_loss(model, objective, made)
    for option, run in given.items():
        if run.model.training:
            fail(f"the frozen run {option!r} was put in training mode (dropout on: not the model that was trained)")
        if thawed := [n for n, p in run.model.named_parameters() if p.requires_grad or p.grad is not None]:
            fail(f"{len(thawed)} parameters of the frozen run {option!r} require or received a gradient (e.g. "
                 f"{thawed[0]}): compute with it under torch.no_grad() and leave it frozen")
        if changed := [n for n, v in run.model.state_dict().items() if not torch.equal(v, before[option][n])]:
            fail(f"the weights of the frozen run {option!r} changed ({changed[0]}, ...)")

    def losses(given_runs) -> tuple[float, float]:
        fresh = subject.objective(vocab, runs=given_runs)
        with torch.no_grad():
            trained = compute_loss(model.train(), fresh, batch := subject.batch(fresh, windows)).loss.item()
        return trained, eval_loss(model, fresh, batch)

    base = losses(None)
    for option in given:
        other = kit_runs(subject, objective, vocab)
        with torch.no_grad(), subject.seeded(subject.seed + 5):
            for p in other[option].model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        if all(abs(a - b) <= DEPENDENT * max(1.0, abs(b)) for a, b in zip(losses(other), base)):
            fail(f"the loss (train mode {base[0]:.6g}, eval mode {base[1]:.6g}) does not change when run {option!r}'s "
                 "model has other weights: the objective does not use the run it asks for")


def reports(subject) -> None:
    """After a loss call, in train mode (with its backward) and in eval mode, ``take_reports()`` is a
    dict of name → (sum, count): each name a lowercase identifier other than loss, ppl, exit_losses, extra_losses
    (they become metrics.jsonl's ``train_<name>``/``val_<name>``), each sum a finite one-element
    tensor without a gradient (the core keeps sums over a logging interval: one holding its graph
    would hold every step's activations), each count an int ≥ 1; a second call right after is
    empty (the core takes them after every loss call)."""
    from lmlab.model import compute_loss

    objective, _, made = subject.sample()
    model = subject.model(objective).train()
    compute_loss(model, objective, made).total.backward()
    _check_reports(objective.take_reports(), "in train mode")
    if objective.take_reports():
        fail("take_reports() called twice in a row gave figures the second time: it must empty them")
    eval_loss(model, objective, made)
    _check_reports(objective.take_reports(), "in eval mode")


def _check_reports(taken, when: str) -> None:
    for name, value in taken.items():
        if not (isinstance(name, str) and name.isidentifier() and name == name.lower()) or name in RESERVED_REPORTS:
            fail(f"{when}, a figure is named {name!r}: a name is a lowercase identifier, not one of "
                 f"{sorted(RESERVED_REPORTS)}")
        if not (isinstance(value, tuple) and len(value) == 2):
            fail(f"{when}, figure {name!r} is {value!r}, not a (sum, count) pair")
        total, count = value
        if isinstance(total, torch.Tensor):
            if total.numel() != 1 or total.requires_grad:
                fail(f"{when}, figure {name!r}'s sum is {total!r}, not a detached one-element tensor")
            total = total.item()
        if not (isinstance(total, (int, float)) and math.isfinite(total)):
            fail(f"{when}, figure {name!r} sums to {total!r}, not a finite number")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            fail(f"{when}, figure {name!r} counts {count!r} values, not an int ≥ 1")

