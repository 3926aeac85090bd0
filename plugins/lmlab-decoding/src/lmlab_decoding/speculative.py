"""Speculative decoding (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318).

A small draft model proposes up to ``k`` tokens, one at a time; the target model scores them all in
one forward pass, and each row keeps the longest prefix the target accepts plus one token of the
target's own. The text is exactly what decoding the target alone gives:

* greedy (``temperature`` 0): a draft token is accepted when it is the target's argmax; the first
  one that is not is replaced by the target's argmax; if all ``k`` are accepted, the target's argmax
  after them is added. The output equals the target's greedy output token for token (so long as the
  prompt and its new tokens fit in the model's context: past it, the sliding window keeps up to ``k``
  fewer tokens than one-token steps do).
* sampling: with p the target's and q the draft's distribution, both filtered alike (``temperature``,
  then ``top_k``, then ``top_p``, as ``sample``), a draft token x ~ q is accepted with probability
  min(1, p(x) / q(x)); the first rejected one is replaced by a draw from norm(max(0, p − q)); if all
  are accepted, a bonus token is drawn from p. Each new token is then distributed as under p.

Rows advance together and accept different counts: the target verifies each row's pending token and
its drafts with ``Engine.step(rows, tokens (B, k + 1))``, and both engines ``rewind`` the rejected
tokens. A row is never fed past its most new tokens: it proposes at most (tokens left − 1). The
first new token comes from the target's prompt logits (there is nothing to verify yet).

The draft is the run folder named by ``draft`` (``needs_runs``): the core loads it, checks its
tokenizer against the target's and calls ``prepare``. Without it (``Decoder.generate`` called
directly, or the sample ``lmlab run`` prints after training) the decoder samples the target alone,
with the same distribution. ``stats`` counts the draft tokens proposed and accepted over every
``decode`` call since the decoder was made (assign ``{"proposed": 0, "accepted": 0}`` to start
again); ``acceptance_rate`` is their ratio.
"""

from typing import Iterator

import torch

from lmlab.api import Decoder, DecodingOptions, Engine, Field, LanguageModel, Outputs
from lmlab_decoding.sample import filter_logits


class SpeculativeOptions(DecodingOptions):
    draft: str = Field(..., min_length=1, help="the draft model's run folder (same tokenizer as the target's)")
    k: int = Field(4, ge=1, help="draft tokens proposed per round")
    temperature: float = Field(0.0, ge=0, help="0: greedy; else sample from softmax(logits / temperature)")
    top_k: int | None = Field(None, ge=1, help="sample among the k most likely tokens only (unset: all)")
    top_p: float | None = Field(None, gt=0, le=1, help="sample within the smallest set of mass >= top_p (unset: all)")


class SpeculativeDecoder(Decoder):
    api = ">=1.21,<2"  # report; Decoder.decode over an Engine, needs_runs (1.8)
    Options = SpeculativeOptions
    needs_runs = ("draft",)

    def __init__(self, options: SpeculativeOptions | None = None):
        super().__init__(options)
        self.draft_model: LanguageModel | None = None
        self.stats = {"proposed": 0, "accepted": 0}
        """Draft tokens proposed and accepted by every decode call so far."""

    def prepare(self, target: LanguageModel, runs: dict[str, LanguageModel]) -> None:
        self.draft_model = runs.get("draft")

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens so far (``stats``); None when none was proposed."""
        proposed = self.stats["proposed"]
        return self.stats["accepted"] / proposed if proposed else None

    def report(self) -> str | None:
        rate = self.acceptance_rate
        return None if rate is None else f"{rate:.0%} of {self.stats['proposed']} drafted tokens accepted"

    # -- distributions -------------------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.options.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (..., V) → the filtered distribution (..., V), float32."""
        o = self.options
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return filter_logits(flat, o.temperature, o.top_k, o.top_p).softmax(dim=-1).view(logits.shape)

    def choose(self, logits: torch.Tensor,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits (B, V) → tokens (B,) and, when sampling, the distribution they were drawn from (B, V)."""
        if self.greedy:
            return logits.argmax(dim=-1), None
        probs = self.probs(logits)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], probs

    # -- the loop ------------------------------------------------------------------------------------

    def decode(self, engine: Engine, prompts: list[list[int]], outputs: Outputs,
               generator: torch.Generator | None = None) -> Iterator[dict[int, list[int]]]:
        rows, logits = engine.add(prompts)
        first, _ = self.choose(logits, generator)
        yield {i: [t] for i, t in enumerate(first.tolist())}
        live = [i for i in range(len(prompts)) if not outputs.done(i)]
        engine.release([rows[i] for i in range(len(prompts)) if outputs.done(i)])
        if not live:
            return
        made = {i: 1 for i in live}  # new tokens per prompt so far
        pending = {i: int(first[i]) for i in live}  # the last new token, which neither engine has consumed
        draft, drows, behind = None, {}, {}
        if self.draft_model is not None:
            draft = engine.companion(self.draft_model)
            draft_rows, _ = draft.add([prompts[i] for i in live])
            drows = dict(zip(live, draft_rows))
            behind = {i: [pending[i]] for i in live}  # tokens the draft has yet to consume
        device = logits.device
        while live:
            ks = {i: min(self.options.k, outputs.max_new_tokens(i) - made[i] - 1) if draft is not None else 0
                  for i in live}
            proposals, q = ({}, {}) if draft is None else self._propose(draft, drows, behind, ks, generator, device)
            new: dict[int, list[int]] = {}
            for k in sorted(set(ks.values())):
                group = [i for i in live if ks[i] == k]
                fed = torch.tensor([[pending[i]] + proposals.get(i, []) for i in group], dtype=torch.long,
                                   device=device)
                p_logits = engine.step([rows[i] for i in group], fed)  # (B, k + 1, V)
                dists = [q[i] for i in group] if k and not self.greedy else None
                accepted, extra = self._verify(fed[:, 1:], p_logits, dists, generator)
                engine.rewind([rows[i] for i in group], [k - a for a in accepted])
                self.stats["proposed"] += k * len(group)
                self.stats["accepted"] += sum(accepted)
                for i, a, x in zip(group, accepted, extra):
                    new[i] = proposals.get(i, [])[:a] + [x]
                if draft is not None and k > 0:
                    # The draft consumed what it was behind by and proposals 1..k-1 (not the k-th).
                    draft.rewind([drows[i] for i in group], [max(k - 1 - a, 0) for a in accepted])
                    for i, a, x in zip(group, accepted, extra):
                        behind[i] = [proposals[i][-1], x] if a == k else [x]
                elif draft is not None:
                    for i, x in zip(group, extra):
                        behind[i] = behind[i] + [x]
            yield new
            for i, tokens in new.items():
                made[i] += len(tokens)
                pending[i] = tokens[-1]
            ended = [i for i in live if outputs.done(i) or made[i] >= outputs.max_new_tokens(i)]
            if ended:
                engine.release([rows[i] for i in ended])
                if draft is not None:
                    draft.release([drows[i] for i in ended])
                gone = set(ended)
                live = [i for i in live if i not in gone]

    def _propose(self, draft: Engine, drows: dict[int, int], behind: dict[int, list[int]], ks: dict[int, int],
                 generator: torch.Generator | None, device) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Each row i with ks[i] ≥ 1 draws ks[i] tokens from the draft; returns them and, when sampling,
        the draft's distributions (ks[i], V) they were drawn from."""
        rows = [i for i in ks if ks[i] > 0]
        proposals: dict[int, list[int]] = {i: [] for i in rows}
        dists: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        feeding = {}
        for n in sorted({len(behind[i]) for i in rows}):  # the first step: what each row has yet to consume
            group = [i for i in rows if len(behind[i]) == n]
            fed = torch.tensor([behind[i] for i in group], dtype=torch.long, device=device)
            feeding.update(zip(group, draft.step([drows[i] for i in group], fed)[:, -1]))
        for i in rows:
            behind[i] = []
        group = rows
        logits = torch.stack([feeding[i] for i in group]) if group else None
        for j in range(1, max((ks[i] for i in rows), default=0) + 1):
            tokens, probs = self.choose(logits, generator)
            for n, i in enumerate(group):
                proposals[i].append(int(tokens[n]))
                if probs is not None:
                    dists[i].append(probs[n])
            keep = [n for n, i in enumerate(group) if ks[i] > j]
            if not keep:
                break
            group = [group[n] for n in keep]
            logits = draft.step([drows[i] for i in group], tokens[keep][:, None])[:, -1]
        return proposals, {i: torch.stack(d) for i, d in dists.items() if d}

    def _verify(self, drafted: torch.Tensor, p_logits: torch.Tensor, q: list[torch.Tensor] | None,
                generator: torch.Generator | None) -> tuple[list[int], list[int]]:
        """drafted (B, k) tokens, p_logits (B, k + 1, V) the target's logits over them (position j
        scores drafted[:, j]), q the draft's distributions (B of (k, V)) when sampling → per row the
        number of drafted tokens accepted and the token that follows them (correction or bonus)."""
        B, k = drafted.shape
        if self.greedy:
            best = p_logits.argmax(dim=-1)                                              # (B, k + 1)
            ok = drafted == best[:, :k]
            accepted = ok.long().cumprod(dim=1).sum(dim=1)                              # (B,)
            return accepted.tolist(), best.gather(1, accepted[:, None])[:, 0].tolist()
        p = self.probs(p_logits)                                                        # (B, k + 1, V)
        if k == 0:
            return [0] * B, torch.multinomial(p[:, 0], 1, generator=generator)[:, 0].tolist()
        q = torch.stack(q)                                                              # (B, k, V)
        p_x = p[:, :k].gather(2, drafted[:, :, None])[:, :, 0]
        q_x = q.gather(2, drafted[:, :, None])[:, :, 0]
        u = torch.rand(B, k, generator=generator, device=p.device)
        ok = u * q_x < p_x  # accept x with probability min(1, p(x) / q(x)); q(x) > 0 as x was drawn from q
        accepted = ok.long().cumprod(dim=1).sum(dim=1)                                  # (B,)
        at = accepted[:, None, None].expand(B, 1, p.shape[-1])
        p_at = p.gather(1, at)[:, 0]                                                    # (B, V)
        q_at = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, at)[:, 0]  # 0 after all k: p itself
        residual = (p_at - q_at).clamp(min=0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_at)
        extra = torch.multinomial(residual, 1, generator=generator)[:, 0]
        return accepted.tolist(), extra.tolist()
