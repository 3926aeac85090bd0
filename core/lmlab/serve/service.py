"""The served run: its model behind a :class:`~lmlab.serve.scheduler.Scheduler`, its tokenizer, its
context and (for an instruction-tuned run) its chat template; requests become scheduler jobs here.

The context is the model's position limit (``model.max_context``), or its ``block_size`` when the
position scheme has none. A request's prompt plus ``max_tokens`` must fit in it (else a 400, as
OpenAI and vLLM answer), so every request ends by the context: none can hold a row for ever.
"""

import threading
import time
from pathlib import Path

from lmlab.errors import UserError
from lmlab.generation.outputs import Outputs
from lmlab.serve.decoding import RequestOptions, engine_settings, generator, servable
from lmlab.serve.memory import check_fits
from lmlab.serve.protocol import ApiError, ChatRequest, CompletionRequest
from lmlab.serve.scheduler import Job, Scheduler


class LockedTokenizer:
    """A tokenizer shared by the handlers (encode) and the scheduler thread (decode), one call at a time:
    not every tokenizer library allows concurrent calls on one object."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.eos_id = tokenizer.eos_id
        self.vocab_size = tokenizer.vocab_size
        self.template = tokenizer.chat_template()  # the model's own (API 1.20), or None
        self._lock = threading.Lock()

    def chat_template(self) -> str | None:
        return self.template

    def special_id(self, name: str) -> int | None:
        return self.inner.special_id(name)

    def encode(self, text: str):
        with self._lock:
            return self.inner.encode(text)

    def decode(self, ids):
        with self._lock:
            return self.inner.decode(ids)


class Service:
    """What the HTTP app serves: one model under one id, decoded by ``decoder`` (a ``TokenDecoder``)."""

    def __init__(self, model, tokenizer, *, decoder, model_id: str, template=None, data_name: str | None = None,
                 conversation_template: str | None = None, max_batch: int = 32, cache: str = "paged", block_size: int = 16, n_blocks: int | None = None,
                 seed: int = 0):
        self.model_id = model_id
        self.request_options = RequestOptions(decoder)
        self.tokenizer = LockedTokenizer(tokenizer)
        self.template = template
        self.conversation_template = conversation_template  # the data source's Jinja template, if its own
        self.data_name = data_name
        self.context = model.max_context if model.max_context is not None else model.block_size
        check_fits(model, max_batch, self.context, cache, block_size, n_blocks)
        self.scheduler = Scheduler(model, decoder, self.context, max_batch=max_batch, cache=cache, block_size=block_size,
                                   n_blocks=n_blocks, seed=seed)
        self.created = int(time.time())

    @classmethod
    def from_run(cls, run_dir: Path, *, overrides: list[str] = (), model_name: str | None = None,
                 **settings) -> "Service":
        """The run in ``run_dir`` (a UserError for a folder that is not a run, or a bidirectional model)."""
        from lmlab.generation.runs import prepare_decoder
        from lmlab.trained import load_run, refuse_bidirectional

        run = load_run(Path(run_dir), list(overrides))
        refuse_bidirectional(run.objective)
        data = run.plugins.get("data")
        template = data.chat_template() if data is not None else None
        own = data.conversation_template() if data is not None else None
        decoder = servable(run.plugins["decoding"])
        settings.update(engine_settings(decoder.options, overrides, settings.get("cache")))
        prepare_decoder(decoder, run)
        name = model_name or Path(run_dir).resolve().name
        return cls(run.model.eval(), run.tokenizer, decoder=decoder, model_id=name, template=template,
                   data_name=getattr(data, "name", None), conversation_template=own, **settings)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    # -- requests to jobs ------------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_id!r} "
                                "(GET /v1/models)", "model", "model_not_found")

    def token_ids(self, ids: list[int], room: int = 1) -> list[int]:
        """A prompt given as token ids, checked against the vocabulary and the context."""
        if not ids:
            raise ApiError(400, "a prompt of token ids holds none", "prompt", "invalid_prompt")
        bad = next((i for i in ids if not 0 <= i < self.tokenizer.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is not in this model's vocabulary (0 to "
                                f"{self.tokenizer.vocab_size - 1})", "prompt", "invalid_prompt")
        if len(ids) + room > self.context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is {self.context} tokens",
                           "prompt", "context_length_exceeded")
        return list(ids)

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids (an empty prompt starts from the end-of-text token, as ``lmlab generate``)."""
        try:
            ids = [int(i) for i in self.tokenizer.encode(text)]
        except UserError as exc:
            raise ApiError(400, f"the prompt cannot be tokenised: {exc}", "prompt", "invalid_prompt") from None
        if not ids:
            if text:
                raise ApiError(400, "the prompt has no token this model's tokenizer knows", "prompt", "invalid_prompt")
            ids = [self.tokenizer.eos_id if self.tokenizer.eos_id is not None else 0]
        if len(ids) >= self.context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is {self.context} tokens, "
                                "and a prompt must leave room for at least one new token",
                           "prompt", "context_length_exceeded")
        return ids

    def completion_jobs(self, request: CompletionRequest) -> list[Job]:
        """One job per prompt and copy (``n``), in the order of the response's choices."""
        self.check_model(request.model)
        options = self.request_options(request.decoder_fields())
        jobs = []
        for prompt in request.prompts():
            room = 0 if request.max_tokens == 0 else 1
            ids = self.encode(prompt) if isinstance(prompt, str) else self.token_ids(prompt, room)
            # OpenAI's default of 16, cut to what the context leaves (a default cannot be refused)
            max_tokens = request.max_tokens if request.max_tokens is not None else min(16, self.context - len(ids))
            first = self._job(ids, max_tokens, request, request.stops(), options)
            for job in self._copies(first, request):
                job.logprobs, job.echo = request.logprobs, bool(request.echo)
                jobs.append(job)
        return jobs

    def chat_jobs(self, request: ChatRequest) -> list[Job]:
        """The conversation's job and its copies (``n``)."""
        jobs = self._copies(self.chat_job(request), request)
        for job in jobs:
            job.logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return jobs

    def _copies(self, job: Job, request) -> list[Job]:
        """``job`` and n - 1 more of the same prompt, each with its own random stream (a seeded request's
        k-th copy seeded with seed + k, so the whole response is reproducible)."""
        out = [job]
        for k in range(1, request.choices):
            outputs = Outputs(self.tokenizer, [job.max_tokens], stop=[list(job.outputs.stops[0])],
                              eos_id=self.tokenizer.eos_id)
            seed = None if request.seed is None else request.seed + k
            out.append(Job(ids=job.ids, max_tokens=job.max_tokens, options=job.options, outputs=outputs,
                           stream=job.stream, generator=generator(seed, self.scheduler.device)))
        return out

    def chat_job(self, request: ChatRequest) -> Job:
        self.check_model(request.model)
        if self.conversation_template is not None or self.tokenizer.chat_template() is not None:
            return self._own_template_job(request)
        if self.template is None:
            raise ApiError(400, f"this run has no chat template: its data source ({self.data_name or 'unknown'}) "
                                "gives none, so chat completions are not offered; use /v1/completions, or serve a "
                                "run instruction-tuned on a data source with one (e.g. data.use = \"alpaca\")",
                           "messages", "chat_template_missing")
        options = self.request_options(request.decoder_fields())
        prompt = self.template.render(request.instruction(), request.given())
        try:
            ids = self.encode(prompt)
        except ApiError as exc:
            exc.param = "messages"
            raise
        max_tokens = request.max_tokens if request.max_tokens is not None else self.context - len(ids)
        stops = ([self.template.stop] if self.template.stop else []) + request.stops()
        return self._job(ids, max_tokens, request, stops, options)

    def _own_template_job(self, request: ChatRequest) -> Job:
        """The whole conversation through the run's Jinja chat template (its data source's, else the
        model's own); the answer ends at EOS."""
        from lmlab.chat_template import prompt_ids

        options = self.request_options(request.decoder_fields())
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text} for m in request.messages]
        try:
            ids = prompt_ids(self.tokenizer, messages, template=self.conversation_template)
        except UserError as exc:
            raise ApiError(400, str(exc), "messages", "chat_template_failed") from None
        if len(ids) >= self.context:
            raise ApiError(400, f"the conversation is {len(ids)} tokens; this model's context is {self.context} tokens",
                           "messages", "context_length_exceeded")
        max_tokens = request.max_tokens if request.max_tokens is not None else self.context - len(ids)
        return self._job(ids, max_tokens, request, request.stops(), options)

    def _job(self, ids: list[int], max_tokens: int, request, stops: list[str], options) -> Job:
        if len(ids) + max_tokens > self.context:
            raise ApiError(400, f"This model's maximum context length is {self.context} tokens. However, you "
                                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                                f"in the completion). Please reduce the prompt or max_tokens (at most "
                                f"{self.context - len(ids)} here).", "max_tokens", "context_length_exceeded")
        outputs = Outputs(self.tokenizer, [max_tokens], stop=[stops], eos_id=self.tokenizer.eos_id)
        return Job(ids=ids, max_tokens=max_tokens, options=options, outputs=outputs, stream=bool(request.stream),
                   generator=generator(request.seed, self.scheduler.device))
