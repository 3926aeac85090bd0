"""Proximal policy optimisation from a reward model (``ppo``): RLHF's third stage.

InstructGPT (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155), after Ziegler et al. 2019
(https://arxiv.org/abs/1909.08593), tunes the supervised policy π (the ``[init]`` run) to maximise a
learnt reward r(x, y) (a ``reward-model`` run, ``reward_run``) while a per-token KL penalty keeps it
near the frozen reference π_ref (``reference``; unset: the ``[init]`` run). Each rollout:

1. the batch's prompts x (each row's label-0 prefix: the prompt of a ``preferences`` or ``alpaca``
   record) are continued by the run's ``[decoding]`` plugin, which must sample (``use = "sample"``;
   its temperature divides the logits here too, top-k/top-p are refused: π would not be what
   sampled), up to ``max_new_tokens`` or the token of ``response_end``;
2. one forward pass each of π (log-probabilities, values), π_ref and the reward model (score at the
   response's last token) gives per-token rewards r_t = −kl_coef · (log π − log π_ref)(y_t), plus the
   score on the last token (Ziegler's shaped reward; TRL's PPOTrainer);
3. GAE (Schulman et al. 2016, https://arxiv.org/abs/1506.02438) with ``gamma`` and ``lam`` turns
   them into advantages A_t and returns, from a value head (``model.heads["value"]``, d_model → 1 on
   the final hidden state before each response token).

The rollout then serves ``ppo_epochs`` optimizer steps, one per training step (the batches of the
steps in between go unused), with PPO's clipped surrogate (Schulman et al. 2017,
https://arxiv.org/abs/1707.06347)

    loss = mean_t max(−A_t ρ_t, −A_t clip(ρ_t, 1 ± clip_range))
         + vf_coef · mean_t ½ max((V_t − R_t)², (V_old + clip(V_t − V_old, ± clip_range_value) − R_t)²)
         − ent_coef · mean_t H(π(·|y_<t))

ρ_t = π(y_t)/π_old(y_t), means over every response token of the batch (ragged responses padded and
masked). Choices, after Huang et al. 2024 ("The N Implementation Details of RLHF with PPO"):

- The rollout's own step reads π_old from its gradient forward pass (detached): one policy pass per
  step, and ρ = 1 exactly there, so ``ppo_epochs = 1`` is the on-policy gradient.
- ``whiten_scores``: a reward model learns only differences (Bradley–Terry), so its offset and
  scale are arbitrary; each rollout's scores are centred and scaled by their batch statistics, which
  makes ``kl_coef`` a price in score standard deviations (Ziegler normalises the reward model once
  on the SFT policy's samples to the same end). ``missing_end_penalty`` is taken off the score of a
  response that never reached its end token (TRL's missing-EOS penalty). ``whiten_advantages``
  normalises A over the batch's tokens (TRL, OpenAI's baselines).
- The value head starts at zero: the first values are the whitened scores' mean. Leave
  ``model.dropout`` at 0: with it, π_old and π differ by dropout noise (Huang et al.).
- Randomness: a rollout samples from a generator seeded by its batch's seed, so a run repeats. A
  resumed run starts a fresh rollout at its first step (the rollout is not checkpointed): resumed
  at a multiple of ``ppo_epochs`` it repeats the uninterrupted run, elsewhere its rollouts fall at
  other steps. ``ppo_epochs > 1`` needs ``train.grad_accum = 1``: each micro-batch would be a
  rollout of its own.

Evaluation samples (with the same decoder, seeded per batch) answers to the held-out prompts;
the loss is −(mean score − kl_coef · mean KL), with the reward model's raw score and KL the
per-sequence sum of log π − log π_ref over the sampled response. Reported (``train_*`` in
metrics.jsonl, ``val_*`` also in the summary): ``reward`` (raw score), ``kl``, ``response_length``,
``truncated`` (rows whose prompt is cut by the row, or leaves no room for ``max_new_tokens``);
in training also ``entropy``, ``clip_fraction``, ``approx_kl`` ((ρ − 1) − log ρ) and ``value_loss``.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from lmlab.api import IGNORE_INDEX, Batch, Field, Objective, Options, TokenSplit, UserError, Vocabulary, Windows
from lmlab.api.batch import stream_seed
from lmlab_objectives.reward_model import score

VALUE = "value"
PROMPT = 0
ROLLOUT_REPORTS = ("reward", "kl", "response_length")  # per rollout, in training on its first step
TRAIN_REPORTS = ("entropy", "clip_fraction", "approx_kl", "value_loss")  # per optimizer step


class ValueHead(nn.Linear):
    """d_model → 1, starting at zero."""

    def __init__(self, d_model: int):
        super().__init__(d_model, 1)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``values`` centred and scaled by their mean and variance over ``mask``; 0 outside it."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean).square(), mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def shaped_rewards(logp: torch.Tensor, ref_logp: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                   kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards, kl), both (N, R): −kl_coef · (log π − log π_ref) per response token, and each row's
    score added on its last token (``mask`` (N, R) marks the response tokens, left-aligned)."""
    kl = (logp - ref_logp) * mask
    rewards = -kl_coef * kl
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores * mask[rows, last]
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) (N, R) by generalised advantage estimation over left-aligned ragged rows:
    A_t = δ_t + γλ A_{t+1}, δ_t = r_t + γ V_{t+1} − V_t, with V and A zero past a row's end."""
    rewards, values = rewards * mask, values * mask
    following = torch.zeros_like(rewards[:, 0])
    advantages = []
    for t in reversed(range(rewards.shape[1])):  # ≤ max_new_tokens steps, each over the whole batch
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(following)
        following = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * following
        advantages.append(following)
    advantages = torch.stack(advantages[::-1], dim=1) * mask
    return advantages, advantages + values


class Losses(NamedTuple):
    policy: torch.Tensor
    value: torch.Tensor
    clipped: torch.Tensor  # (N, R) bool: tokens whose ratio left [1 − clip, 1 + clip]
    approx_kl: torch.Tensor  # (N, R): (ρ − 1) − log ρ, Schulman's unbiased estimate of KL(π_old ‖ π)


def ppo_losses(logp, old_logp, advantages, values, old_values, returns, mask, clip_range: float,
               clip_range_value: float | None) -> Losses:
    """The clipped surrogate and the (clipped) value loss, means over the ``mask``ed tokens (N, R)."""
    log_ratio = (logp - old_logp) * mask
    ratio = log_ratio.exp()
    policy = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range))
    value = (values - returns).square()
    if clip_range_value is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
        value = torch.maximum(value, (clipped_values - returns).square())
    return Losses(masked_mean(policy, mask), 0.5 * masked_mean(value, mask),
                  ((ratio - 1).abs() > clip_range) & mask.bool(), ((ratio - 1) - log_ratio).detach())


@dataclass
class PromptBatch(Batch):
    """The rows as the core keeps them (``input_ids``/``targets``), and where each prompt ends."""

    prompt_lengths: torch.Tensor = None
    """(B,) int64: tokens of each row's prompt (its label-0 prefix)."""
    valid: torch.Tensor = None
    """(B,) bool: rows whose prompt is whole and leaves room for ``max_new_tokens`` in the block."""
    seed: int = 0

    def n_scored(self) -> torch.Tensor:
        """Evaluation weights a batch by its rollouts (the loss is a mean over sequences)."""
        return self.valid.sum()

    def prompts(self) -> list[list[int]]:
        rows, lengths, valid = self.input_ids.tolist(), self.prompt_lengths.tolist(), self.valid.tolist()
        return [row[:n] for row, n, ok in zip(rows, lengths, valid) if ok]


@dataclass
class Rollout:
    """Prompt + response sequences, right-padded, and the response tokens' places (N, R)."""

    ids: torch.Tensor  # (N, T) int64
    at: torch.Tensor  # (N, R) int64: the position whose output predicts response token j
    tokens: torch.Tensor  # (N, R) int64: the response tokens
    mask: torch.Tensor  # (N, R) float: 1 on response tokens
    ended: torch.Tensor  # (N,) bool: the response reached its end token
    ref_logp: torch.Tensor | None = None
    scores: torch.Tensor | None = None  # (N,) the reward model's raw scores
    old_logp: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def last(self) -> torch.Tensor:
        """(N,) each sequence's last real position (the response's last token)."""
        return self.at[:, 0] + self.mask.sum(dim=1).long()


def rollout_tensors(prompts: list[list[int]], responses: list[list[int]], ends, device) -> Rollout:
    """Pack prompt + response rows (any lengths; every response non-empty) into a Rollout."""
    total = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.tensor([p + r + [0] * (total - len(p) - len(r)) for p, r in zip(prompts, responses)],
                       dtype=torch.long, device=device)
    starts = torch.tensor([len(p) for p in prompts], device=device)
    lengths = torch.tensor([len(r) for r in responses], device=device)
    j = torch.arange(int(lengths.max()), device=device)
    mask = j[None, :] < lengths[:, None]
    at = (starts[:, None] - 1 + j).clamp(max=total - 1)
    tokens = ids.gather(1, (at + 1).clamp(max=total - 1)).masked_fill(~mask, 0)
    ended = torch.tensor([bool(r) and r[-1] in ends for r in responses], device=device)
    return Rollout(ids, at, tokens, mask.float(), ended)


def response_logps(model, rollout: Rollout, temperature: float = 1.0, values: bool = False):
    """(log π of the response tokens (N, R), entropies (N, R), values (N, R) or None) from one pass;
    the head and value head run on the response positions only."""
    hidden = model(rollout.ids, hidden=True)  # (N, T, C)
    hidden = hidden.gather(1, rollout.at[..., None].expand(-1, -1, hidden.shape[-1]))  # (N, R, C)
    log_probs = (model.head(hidden).float() / temperature).log_softmax(dim=-1)  # (N, R, V)
    logp = log_probs.gather(-1, rollout.tokens[..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    value = model.heads[VALUE](hidden).squeeze(-1).float() if values else None
    return logp, entropy, value


class PPOOptions(Options):
    reward_run: Path | None = Field(None, help="the folder of a run trained with objective reward-model (required)")
    reference: Path | None = Field(None, help="the frozen reference run folder of the KL penalty; unset: the "
                                              "[init] run")
    kl_coef: float = Field(0.1, ge=0, help="per-token KL penalty to the reference (InstructGPT 0.02, Ziegler 0.1-0.2)")
    ent_coef: float = Field(0.01, ge=0, help="weight of the entropy bonus")
    clip_range: float = Field(0.2, gt=0, help="PPO's ε: the ratio π/π_old is clipped to [1 - ε, 1 + ε]")
    vf_coef: float = Field(0.1, ge=0, help="weight of the value loss")
    clip_range_value: float | None = Field(0.2, gt=0, help="values move at most this far from the rollout's; "
                                                           "unset: unclipped value loss")
    gamma: float = Field(1.0, gt=0, le=1, help="discount over response tokens")
    lam: float = Field(0.95, ge=0, le=1, help="GAE's λ")
    ppo_epochs: int = Field(4, ge=1, help="optimizer steps on each rollout batch (1: a fresh rollout every step)")
    max_new_tokens: int = Field(16, ge=1, help="longest response")
    response_end: str = Field("\n", help="text whose single token ends a response (as preferences' response_end); "
                                         "\"\": only the tokenizer's end-of-text token")
    whiten_scores: bool = Field(True, help="centre and scale each rollout's scores by their batch statistics")
    missing_end_penalty: float = Field(0.0, ge=0, help="taken off the score of a response cut at max_new_tokens")
    whiten_advantages: bool = Field(True, help="normalise the advantages over the batch's response tokens")


class PPO(Objective):
    """``ppo``: clipped policy-gradient steps on sampled responses scored by a reward model."""

    Options = PPOOptions
    api = ">=1.20,<2"  # CheckContext.run; forward_loss, heads, needs_runs, prepare, report (1.10)
    sampling = "documents"
    needs_runs = ("reward_run", "reference")

    def __init__(self, options: PPOOptions | None = None):
        super().__init__(options)
        self.temperature = 1.0
        self.steps = 0  # training loss calls so far: a fresh rollout every ppo_epochs of them
        self.rollout: Rollout | None = None

    def setup(self, vocab: Vocabulary) -> None:
        self.eos_id = vocab.eos_id

    def check(self, context) -> None:
        o = self.options
        if o.reward_run is None:
            raise UserError("ppo needs a reward model: set objective.reward_run to the folder of a run trained with "
                            "objective reward-model", key="objective.reward_run")
        if o.ppo_epochs > 1 and context.run.train.grad_accum > 1:
            raise UserError(f"ppo reuses each rollout for ppo_epochs = {o.ppo_epochs} optimizer steps, and each "
                            "accumulated micro-batch would be a rollout of its own: set train.grad_accum = 1 (or "
                            "objective.ppo_epochs = 1)", key="train.grad_accum")
        if o.max_new_tokens >= context.shape.block_size:
            raise UserError(f"max_new_tokens {o.max_new_tokens} leaves no room for a prompt in model.block_size "
                            f"{context.shape.block_size}", key="objective.max_new_tokens")
        decoder = context.plugins.get("decoding")
        if getattr(decoder, "name", None) != "sample":
            raise UserError(f"ppo learns from responses sampled from the policy, and decoding plugin "
                            f"{getattr(decoder, 'name', None)!r} does not sample them: set [decoding] use = "
                            "\"sample\"", key="decoding.use")
        for key in ("top_k", "top_p"):
            if getattr(decoder.options, key, None) is not None:
                raise UserError(f"ppo's ratios are those of the policy that sampled; {key} truncates it: leave "
                                f"decoding.{key} unset", key=f"decoding.{key}")
        self.temperature = getattr(decoder.options, "temperature", 1.0)

    def check_runs(self, runs) -> None:
        run = runs["reward_run"]
        if run.objective != "reward-model":
            raise UserError(f"the run in {run.path} was trained with objective {run.objective!r}; ppo's reward comes "
                            "from a run trained with objective reward-model", key="objective.reward_run")

    def heads(self, shape):
        return {VALUE: ValueHead(shape.d_model)}

    def prepare(self, context) -> None:
        self.reference = context.runs["reference"].model
        self.reward = context.runs["reward_run"].model
        self.generate = context.generate
        # The probabilities of the rollouts are those of the decoder that sampled them.
        self.temperature = getattr(getattr(context.decoder, "options", None), "temperature", self.temperature)
        ends = [] if self.eos_id is None else [self.eos_id]
        if self.options.response_end:
            ids = [int(i) for i in context.tokenizer.encode(self.options.response_end)]
            if len(ids) != 1:
                raise UserError(f"response_end {self.options.response_end!r} is {len(ids)} tokens; a response ends "
                                "at one token", key="objective.response_end")
            ends += ids
        self.stop_ids = tuple(ends)

    def token_labels(self, split: TokenSplit):
        if split.loss_mask is None:
            raise UserError("ppo takes its prompts from records with an unscored prompt, and this corpus has no loss "
                            "mask; use a data source that yields Records (preferences, alpaca)", key="data.use")
        mask = split.loss_mask
        return lambda positions: mask[positions]

    def make_batch_from(self, windows: Windows) -> PromptBatch:
        tokens, L = windows.tokens, windows.tokens.shape[1]
        prompt = windows.labels == PROMPT
        if windows.padding is not None:
            prompt &= ~windows.padding
        lengths = prompt.long().cumprod(dim=1).sum(dim=1)  # the label-0 prefix
        # Whole (something follows it in the row) and short enough for a response within the block.
        valid = (lengths > 0) & (lengths < L) & (lengths + self.options.max_new_tokens <= L - 1)
        targets = tokens[:, 1:]
        if windows.padding is not None:
            targets = targets.masked_fill(windows.padding[:, 1:], IGNORE_INDEX)
        return PromptBatch(tokens[:, :-1], targets, prompt_lengths=lengths, valid=valid,
                           seed=stream_seed(windows.seed, windows.first_row))

    def sample(self, model, batch: PromptBatch) -> Rollout | None:
        """Responses to the batch's valid prompts, with the reference's log-probabilities and the scores."""
        prompts = batch.prompts()
        if not prompts:
            return None
        device = batch.input_ids.device
        generator = torch.Generator(device=device).manual_seed(batch.seed)
        responses = self.generate(model, prompts, self.options.max_new_tokens, stop_ids=self.stop_ids,
                                  generator=generator)
        kept = [i for i, r in enumerate(responses) if r]  # an empty response has no token to score
        if not kept:
            return None
        rollout = rollout_tensors([prompts[i] for i in kept], [responses[i] for i in kept], self.stop_ids, device)
        with torch.no_grad():
            rollout.ref_logp = response_logps(self.reference, rollout, self.temperature)[0]
            rollout.scores = score(self.reward, rollout.ids, rollout.last)
        return rollout

    def forward_loss(self, model, batch: PromptBatch) -> torch.Tensor:
        self.report("truncated", (~batch.valid).float())
        if not model.training:
            return self.evaluate(model, batch)
        o = self.options
        fresh = self.steps % o.ppo_epochs == 0
        self.steps += 1
        if fresh:
            self.rollout = self.sample(model, batch)
        r = self.rollout
        if r is None:  # no prompt to answer: nothing to learn, and the same figures (none) as other replicas
            self.report_nothing(batch, *TRAIN_REPORTS, *(ROLLOUT_REPORTS if fresh else ()))
            return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
        logp, entropy, values = response_logps(model, r, self.temperature, values=True)
        if fresh:
            self.advantages(r, logp.detach(), values.detach())
        losses = ppo_losses(logp, r.old_logp, r.advantages, values, r.old_values, r.returns, r.mask,
                            o.clip_range, o.clip_range_value)
        mean_entropy = masked_mean(entropy, r.mask)
        on = r.mask.bool()
        self.report("entropy", entropy.detach()[on])
        self.report("clip_fraction", losses.clipped[on].float())
        self.report("approx_kl", losses.approx_kl[on])
        self.report("value_loss", losses.value.detach().reshape(1))
        return losses.policy + o.vf_coef * losses.value - o.ent_coef * mean_entropy

    def advantages(self, r: Rollout, old_logp: torch.Tensor, old_values: torch.Tensor) -> None:
        """Fill the rollout's π_old, V_old, advantages and returns; report its reward, KL and lengths."""
        o = self.options
        scores = r.scores
        if o.whiten_scores and scores.numel() > 1:
            scores = (scores - scores.mean()) / (scores.std() + 1e-8)
        scores = scores - o.missing_end_penalty * (~r.ended).float()
        rewards, kl = shaped_rewards(old_logp, r.ref_logp, scores, r.mask, o.kl_coef)
        advantages, returns = gae(rewards, old_values, r.mask, o.gamma, o.lam)
        if o.whiten_advantages:
            advantages = masked_whiten(advantages, r.mask)
        r.old_logp, r.old_values, r.advantages, r.returns = old_logp, old_values * r.mask, advantages, returns
        self.report("reward", r.scores)
        self.report("kl", kl.sum(dim=1))
        self.report("response_length", r.mask.sum(dim=1))

    def report_nothing(self, batch: PromptBatch, *names: str) -> None:
        # Every process must report the same names (their sums are reduced together), even without samples.
        for name in names:
            self.report(name, batch.input_ids.new_zeros(0, dtype=torch.float32))

    def evaluate(self, model, batch: PromptBatch) -> torch.Tensor:
        r = self.sample(model, batch)
        if r is None:
            self.report_nothing(batch, *ROLLOUT_REPORTS)
            return torch.zeros((), device=batch.input_ids.device)
        logp = response_logps(model, r, self.temperature)[0]
        kl = ((logp - r.ref_logp) * r.mask).sum(dim=1)
        self.report("reward", r.scores)
        self.report("kl", kl)
        self.report("response_length", r.mask.sum(dim=1))
        return -(r.scores - self.options.kl_coef * kl).mean()
