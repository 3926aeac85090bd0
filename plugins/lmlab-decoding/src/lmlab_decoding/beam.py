"""Beam search: keep the ``width`` most likely partial continuations of each prompt at every step.

Each prompt holds ``width`` rows of the engine (its beams). At a step, every live beam of every
prompt is fed its last token in one forward pass; the candidates of a prompt are its beams times the
vocabulary, scored by their summed log-probability, and the best ``2 × width`` are read in order, as
Hugging Face's beam search does (transformers 5.x ``GenerationMixin._beam_search``; earlier
``BeamSearchScorer``):

* a candidate that ends the prompt (``Outputs.ends``: the end-of-text id, a stop string, or the
  prompt's most new tokens) becomes a finished hypothesis, if it ranks among the first ``width``
  candidates, scored ``sum of log-probabilities / length ** length_penalty`` where ``length`` is the
  number of generated tokens, the end-of-text token included (transformers 5.x divides by
  ``cur_len + 1 - decoder_prompt_len``; older releases divided by the whole sequence, prompt
  included, which lets a prompt's length change how its continuations rank; we follow the newer
  rule, so prompts of different lengths in one batch are scored alike);
* the others continue, until ``width`` live beams are found; the engine's rows are re-selected with
  ``Engine.assign`` (a beam may continue in several rows).

A prompt keeps its best ``width`` finished hypotheses. With ``early_stopping`` (Hugging Face's
``early_stopping=True``) it is finished as soon as it holds ``width`` of them. Without it, it goes on
until no live beam can still beat the worst of them: the log-probabilities of a beam's continuations
only fall, so the best score a beam can reach is its sum / ``max_new_tokens ** length_penalty`` when
``length_penalty > 0``, its sum / ``(its length + 1) ** length_penalty`` when ``< 0`` (Hugging
Face's exact ``early_stopping="never"``, not its heuristic ``False``). With no live beam left it is finished
too. Its best hypothesis is yielded at once, whole (beam search cannot stream: until a prompt is
finished, any token of the best hypothesis may still change), and ``Outputs.offer`` receives the
``n_best`` best, each (tokens without the final end-of-text id, score).

``repetition_penalty`` and ``no_repeat_ngram_size`` act on each beam's log-probabilities (its prompt
and tokens so far as history) before they are added to its sum, where Hugging Face's beam search
applies its logits processors, so a penalised search ranks and scores as transformers' does.
"""

import math
from typing import Iterator

import torch
from pydantic import model_validator

from lmlab.api import Decoder, Engine, Field, Outputs, TokenRows
from lmlab_decoding.penalties import PenaltyOptions, penalize


class BeamOptions(PenaltyOptions):
    width: int = Field(4, ge=1, help="beams (hypotheses kept) per prompt; 1 is greedy decoding")
    length_penalty: float = Field(0.6, help="a hypothesis scores sum(log p) / length ** length_penalty (length: "
                                            "generated tokens); > 0 favours longer ones, < 0 shorter")
    early_stopping: bool = Field(True, help="finish a prompt once it has `width` finished hypotheses (false: once "
                                            "no live beam can beat the worst of them)")
    n_best: int = Field(1, ge=1, help="ranked alternatives offered per prompt (at most width)")

    @model_validator(mode="after")
    def _n_best_within_width(self):
        if self.n_best > self.width:
            raise ValueError(f"n_best ({self.n_best}) cannot exceed width ({self.width}): only `width` finished "
                             "hypotheses are kept")
        return self


class _Prompt:
    """One prompt's search: its beams (rows, tokens, summed log-probs) and finished hypotheses."""

    def __init__(self, index: int, row: int):
        self.index = index
        self.rows = [row]
        self.seqs: list[list[int]] = [[]]
        self.sums: list[float] = [0.0]
        self.finished: list[tuple[float, list[int]]] = []  # (score, tokens), best first, at most width

    def add_finished(self, score: float, tokens: list[int], width: int) -> None:
        self.finished.append((score, tokens))
        self.finished.sort(key=lambda h: -h[0])
        del self.finished[width:]


class BeamDecoder(Decoder):
    api = ">=1.21,<2"  # TokenRows.history (the penalties); Decoder.decode over an Engine (1.8)
    Options = BeamOptions

    def rows_per_prompt(self) -> int:
        return self.options.width

    def score(self, log_prob: float, length: int) -> float:
        """A finished hypothesis's score: its summed log-probability over length ** length_penalty."""
        return log_prob / (length ** self.options.length_penalty)

    def decode(self, engine: Engine, prompts: list[list[int]], outputs: Outputs,
               generator: torch.Generator | None = None) -> Iterator[dict[int, list[int]]]:
        W, V = self.options.width, engine.vocab_size
        rows, logits = engine.add(prompts)
        live = [_Prompt(i, row) for i, row in enumerate(rows)]
        step = 0  # tokens every live beam holds
        while live:
            B = len(live[0].rows)  # beams per prompt: 1 at the first step, then width
            log_probs = self._penalized(logits.double().log_softmax(dim=-1), live, prompts).view(len(live), B, V)
            sums = torch.tensor([p.sums for p in live], dtype=torch.float64, device=log_probs.device)
            totals = (sums[:, :, None] + log_probs).view(len(live), B * V)
            K = min(2 * W, B * V)
            top_sums, top_ids = (t.tolist() for t in totals.topk(K, dim=-1))
            going, made = [], {}
            for n, p in enumerate(live):
                chosen = self._select(p, outputs, top_sums[n], top_ids[n], totals[n], step, V)
                if self._finished(p, chosen, outputs, step):
                    made[p.index] = self._conclude(p, chosen, outputs, step)
                else:
                    going.append((p, chosen))
            if made:
                yield made
                engine.release([r for p in live if p.index in made for r in p.rows])
            if not going:
                return
            if step == 0 and W > 1:  # each prompt's single row becomes its width rows
                for p, _ in going:
                    p.rows = p.rows + engine.fork([p.rows[0]] * (W - 1))
            dst, src, feed = [], [], []
            for p, chosen in going:
                # Rows past the live beams (fewer than width candidates could continue) copy the
                # first beam and carry a summed log-probability of -inf: their candidates are never read.
                chosen = chosen + [(chosen[0][0], chosen[0][1], -math.inf)] * (W - len(chosen))
                dst += p.rows
                src += [p.rows[b] for b, _, _ in chosen]
                feed += [t for _, t, _ in chosen]
                p.seqs = [p.seqs[b] + [t] for b, t, _ in chosen]
                p.sums = [s for _, _, s in chosen]
            if step > 0:
                engine.assign(dst, src)
            live = [p for p, _ in going]
            tokens = torch.tensor(feed, dtype=torch.long, device=logits.device)[:, None]
            logits = engine.step(dst, tokens)[:, -1]
            step += 1

    def _penalized(self, log_probs: torch.Tensor, live: list[_Prompt], prompts: list[list[int]]) -> torch.Tensor:
        """log_probs (rows, V) with the repetition penalty and n-gram ban applied to each beam."""
        o = self.options
        if o.repetition_penalty == 1 and o.no_repeat_ngram_size == 0:
            return log_probs
        beams = [prompts[p.index] + seq for p in live for seq in p.seqs]
        return penalize(log_probs, TokenRows([o] * len(beams), [None] * len(beams), history=lambda: beams))

    def _select(self, p: _Prompt, outputs: Outputs, sums: list[float], ids: list[int], totals: torch.Tensor,
                step: int, V: int) -> list[tuple[int, int, float]]:
        """Read prompt p's candidates best first: keep the finished ones that rank among the first
        width, return the first width that continue as (beam, token, summed log-prob)."""
        W = self.options.width
        at_limit = step + 1 >= outputs.max_new_tokens(p.index)  # every candidate ends: read only width
        chosen: list[tuple[int, int, float]] = []
        seen: set[int] = set()
        while True:
            for s, flat in zip(sums, ids):
                if flat in seen:
                    continue
                rank = len(seen)
                if s == -math.inf or (at_limit and rank >= W):
                    return chosen
                seen.add(flat)
                beam, token = divmod(flat, V)
                tokens = p.seqs[beam] + [token]
                if at_limit or outputs.ends(p.index, tokens):
                    if rank < W:
                        p.add_finished(self.score(s, step + 1), tokens, W)
                else:
                    chosen.append((beam, token, s))
                    if len(chosen) == W:
                        return chosen
            if len(seen) >= totals.numel():
                return chosen
            # More than width of the first 2 × width candidates ended (stop strings): read on, in
            # the same order (ties broken by id), skipping those read.
            ordered, order = totals.sort(descending=True, stable=True)
            sums, ids = ordered.tolist(), order.tolist()

    def _finished(self, p: _Prompt, chosen: list[tuple[int, int, float]], outputs: Outputs, step: int) -> bool:
        W, lp = self.options.width, self.options.length_penalty
        if not chosen:
            return True
        if len(p.finished) < W:
            return False
        if self.options.early_stopping:
            return True
        # The best score any continuation of a live beam can reach (its log-probs only fall).
        length = outputs.max_new_tokens(p.index) if lp > 0 else step + 2
        best = max(s for _, _, s in chosen) / (length ** lp)
        return best <= p.finished[-1][0]

    def _conclude(self, p: _Prompt, chosen: list[tuple[int, int, float]], outputs: Outputs,
                  step: int) -> list[int]:
        """Offer prompt p's n best hypotheses; return the best one's tokens."""
        ranked = list(p.finished)
        if not ranked:  # nothing finished (every candidate impossible): the live beams, as they stand
            ranked = sorted(((self.score(s, step + 1), p.seqs[b] + [t]) for b, t, s in chosen),
                            key=lambda h: -h[0])
        eos = outputs.eos_id
        offered = [(tokens[:-1] if tokens and tokens[-1] == eos else tokens, score)
                   for score, tokens in ranked[:self.options.n_best]]
        outputs.offer(p.index, offered)
        return ranked[0][1]
