"""A trained lmlab run as a language model of EleutherAI's lm-evaluation-harness (``lm-eval``).

``loglikelihood`` and ``loglikelihood_rolling`` score token sequences in batches of one forward pass
each (the requests sorted longest first, so a batch pads little; padding sits after each row's
tokens, where a causal model's earlier positions never see it); ``generate_until`` continues the
prompts in batches through lmlab's generation engine with the run's decoding plugin (greedy unless
the run's ``[decoding]`` says otherwise) and its KV cache. Text is encoded by the run's own
tokenizer, as the run was trained: with no beginning-of-text token added.

    import lm_eval
    from lmlab.harness.model import LmlabLM
    lm_eval.simple_evaluate(model=LmlabLM.from_run("runs/ft/default"), tasks=["shakespeare_next_line"])

or, once this module is imported (it registers the name), ``simple_evaluate(model="lmlab",
model_args="run=runs/ft/default,batch_size=16", ...)``.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from lmlab.errors import UserError


@register_model("lmlab")
class LmlabLM(TemplateLM):
    """An lmlab run scored by lm-eval. ``run``: a loaded run (:func:`lmlab.trained.load_run`) or its folder."""

    def __init__(self, run=None, batch_size: int | str = 8, max_length: int | str | None = None, **_ignored):
        super().__init__()
        from lmlab.trained import load_run, refuse_bidirectional

        if run is None:
            raise UserError("lm-eval's lmlab model needs run=RUN_DIR in its model_args", key="--model_args")
        self.run = load_run(Path(run)) if isinstance(run, (str, Path)) else run
        refuse_bidirectional(self.run.objective)
        self.model = self.run.model.eval()
        self.tokenizer_ = self.run.tokenizer
        self.batch_size = int(batch_size)
        context = self.model.max_context if self.model.max_context is not None else self.model.block_size
        # Tokens scored in one window (the model's context; fewer when asked, as lm-eval's max_length).
        self.max_length = min(int(max_length), context) if max_length else context
        self._device = next(self.model.parameters()).device

    @classmethod
    def from_run(cls, run_dir, **kwargs) -> "LmlabLM":
        return cls(run=run_dir, **kwargs)

    # -- tokens ----------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer_.eos_id
        if eos is not None:
            return int(eos)
        # A tokenizer without an end-of-text token (char, byte): a line break starts a text as well.
        line = self.tok_encode("\n")
        return line[0] if line else 0

    @property
    def prefix_token_id(self) -> int:
        """What an empty context starts from: the beginning-of-text token where the tokenizer has one, as
        lm-eval's hf model does, else the end-of-text token."""
        bos = self.tokenizer_.special_id("bos")
        return int(bos) if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return [int(i) for i in self.tokenizer_.encode(string)]

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer_.decode(list(tokens))

    # -- scoring ---------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Per (key, context ids, continuation ids): the continuation's summed log-probability and
        whether greedy decoding would have produced it; a window longer than the model's context keeps
        its last tokens."""
        rows = []  # per request: the model's input ids and the ids it must predict at its last positions
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval asked for the log-likelihood of an empty continuation")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            n = min(len(continuation), len(whole) - 1)
            rows.append((whole[:-1], whole[-n:]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            idx = torch.zeros(len(batch), len(rows[batch[0]][0]), dtype=torch.long)
            for r, i in enumerate(batch):
                idx[r, :len(rows[i][0])] = torch.tensor(rows[i][0])
            with torch.no_grad():
                logprobs = F.log_softmax(self.model(idx.to(self._device)).float(), dim=-1).cpu()
            for r, i in enumerate(batch):
                inputs, wanted = rows[i]
                scores = logprobs[r, len(inputs) - len(wanted):len(inputs)]
                wanted = torch.tensor(wanted)
                total = float(scores.gather(1, wanted[:, None]).sum())
                greedy = bool((scores.argmax(-1) == wanted).all())
                results[i] = (total, greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], (total, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood under the model, scored in disjoint windows of the model's
        context, each conditioned on as much of the text before it as fits (lm-eval's rolling windows)."""
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each prompt continued by the run's decoding plugin until one of its ``until`` strings (cut
        there) or ``max_gen_toks`` tokens; prompts longer than the context leave room by dropping their
        start."""
        from lmlab.generation.batch import generate_texts
        from lmlab.generation.runs import prepare_decoder

        decoder = self.run.plugins["decoding"]
        prepare_decoder(decoder, self.run)
        answers: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            room = self.max_length - max_new
            if room < 1:
                raise UserError(f"the task asks for {max_new} new tokens, and this model's context is "
                                f"{self.max_length}", key="max_gen_toks")
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                prompts = [self._fit(requests[i].args[0], room) for i in batch]
                result = generate_texts(self.model, self.tokenizer_, decoder, prompts, max_new, stop=until)
                for i, completion in zip(batch, result.outputs.completions):
                    text = completion.text
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    answers[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return answers

    # -- chat (--apply-chat-template) ---------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return f"lmlab-{self.run.variant.uses('tokenizer')}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        from lmlab.chat_template import run_template

        return run_template(self.tokenizer_, self.run.plugins.get("data")) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        from lmlab.chat_template import prompt_text, run_template

        data = self.run.plugins.get("data")
        if run_template(self.tokenizer_, data) is None:
            raise UserError("the run has no chat template (its tokenizer's, or its data plugin's)",
                            key="--apply-chat-template")
        own = data.conversation_template() if data is not None else None
        return prompt_text(self.tokenizer_, chat_history, "--apply-chat-template", template=own)

    def _fit(self, prompt: str, room: int) -> str:
        ids = self.tok_encode(prompt)
        return prompt if len(ids) <= room else self.tok_decode(ids[-room:])

