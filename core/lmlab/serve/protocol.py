"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, and the OpenAI error object.

Bodies are parsed strictly (a number given as a string is refused, as OpenAI does); fields OpenAI
defines that this server does not implement are accepted at their neutral value (``suffix: null``,
``tools: null``...) and refused otherwise, rather than silently ignored. Every other top-level field
(``temperature``, ``top_p``, ``min_p``, penalties...) is kept for the run's decoder
(:mod:`lmlab.serve.decoding`): an option of its ``Options`` sets that option for the request, any
other is refused naming it. ``seed`` gives the request a random generator of its own, so the same
request gives the same text whatever else is decoded beside it; ``user`` is accepted and ignored.

Every refusal is an :class:`ApiError`, sent as ``{"error": {"message", "type", "param", "code"}}``.
"""

import json
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


class ApiError(Exception):
    """A refused request: its HTTP status and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


# torch.Generator.manual_seed's range
SEEDS = (-(1 << 63), (1 << 64) - 1)
MAX_N = 16  # completions per prompt
MAX_TOP_LOGPROBS = 20  # the most likely tokens listed per position, as OpenAI's chat API allows


class _Sampling(_Body):
    """What both endpoints take: the model, the length, stops, streaming, the seed; every other
    field is the decoder's (``decoder_fields``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    seed: int | None = None
    user: str | None = None  # accepted, ignored

    def check(self) -> None:
        """Refuse values the types allow but the server does not (n past MAX_N, a seed torch takes)."""
        least = 0 if self.scores_prompts else 1
        if self.max_tokens is not None and self.max_tokens < least:
            raise ApiError(400, f"max_tokens must be at least {least}, got {self.max_tokens}", "max_tokens")
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ApiError(400, f"n must be from 1 to {MAX_N}, got {self.n}", "n")
        if self.stream and self.choices > 1:
            raise ApiError(400, "a streamed request makes one completion (n = 1, one prompt)", "stream")
        if self.seed is not None and not SEEDS[0] <= self.seed <= SEEDS[1]:
            raise ApiError(400, f"seed must be a 64-bit integer, got {self.seed}", "seed")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
        for s in self.stops():
            if s == "":
                raise ApiError(400, "a stop string cannot be empty", "stop")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    #: Whether max_tokens = 0 is allowed (a completion that only scores its prompt, with echo).
    scores_prompts: ClassVar[bool] = False

    @property
    def choices(self) -> int:
        """How many completions the request asks for: n per prompt."""
        return self.n or 1

    def decoder_fields(self) -> dict[str, Any]:
        """The fields left for the decoder: every one this class does not declare, as given."""
        return dict(self.model_extra or {})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt (text or token ids) or a list of them, each completed ``n``
    times; ``logprobs`` lists each token's log-probability and the most likely ones, ``echo`` puts the
    prompt (with its tokens' log-probabilities) before the completion, so ``echo`` with ``max_tokens =
    0`` scores a text, as evaluation clients (lm-eval's ``local-completions``) do."""

    scores_prompts: ClassVar[bool] = True

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list) and not self.prompt:
            raise ApiError(400, "prompt is an empty list", "prompt")
        if self.stream and len(self.prompts()) > 1:
            raise ApiError(400, "a streamed request makes one completion (n = 1, one prompt)", "stream")
        if self.best_of not in (None, 1, self.choices):
            raise ApiError(400, "best_of must equal n (every completion made is returned)", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs}", "logprobs")
        if self.stream and (self.logprobs is not None or self.echo):
            raise ApiError(400, "logprobs and echo are given only without streaming", "stream")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens = 0 makes nothing: give echo = true to score the prompt", "max_tokens")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or as token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``max_tokens`` (or ``max_completion_tokens``) defaults to what
    the context leaves after the prompt."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        super().check()
        if not self.messages:
            raise ApiError(400, "messages must hold at least one message", "messages")
        if self.messages[-1].role != "user":
            raise ApiError(400, f"the last message must be the user's (got {self.messages[-1].role!r}): the model "
                                "answers the last user message", "messages")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs = true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                               "top_logprobs")
        if self.stream and self.logprobs:
            raise ApiError(400, "logprobs are given only without streaming", "stream")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ApiError(400, "tools are not supported", "tools")
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "response_format is not supported (only {\"type\": \"text\"})", "response_format")

    def instruction(self) -> str:
        """The last user message: the instruction of the run's template."""
        return self.messages[-1].text

    def given(self) -> str:
        """The system (or developer) messages, joined: the input of the run's template."""
        return "\n".join(m.text for m in self.messages if m.role in ("system", "developer"))


def parse(model: type[_Body], body: bytes) -> Any:
    """A request body: JSON, an object, of ``model``'s shape and values (its ``check``); else ApiError."""
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise ApiError(400, f"the request body is not valid JSON: {why}{where}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON for this server: it is nested too deeply",
                       code="invalid_json") from None
    if not isinstance(raw, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(raw).__name__}")
    try:
        request = model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check()
    return request


def validation_error(exc: ValidationError) -> ApiError:
    """Pydantic's errors for the first parameter at fault, as OpenAI words them: the parameter named."""
    errors = exc.errors()
    if errors[0]["type"] == "json_invalid":  # pydantic's own parser gives up on deep nesting sooner than json's
        return ApiError(400, f"the request body is not valid JSON for this server: {errors[0]['msg']}",
                        code="invalid_json")
    param, _ = _where(errors[0]["loc"])
    if errors[0]["type"] == "missing":
        return ApiError(400, f"missing required parameter: {param!r}", param)
    # A union (str | list[str]) reports one error per member: say them all.
    reasons = []
    for e in errors:
        at, rest = _where(e["loc"])
        if at == param:
            reasons.append(f"{rest}: {e['msg']}" if rest else e["msg"])
    value = errors[0].get("input")
    try:
        shown = f" (got {json.dumps(value)[:80]})"
    except (TypeError, ValueError):
        shown = ""
    return ApiError(400, f"invalid value for {param!r}: {'; or '.join(reasons)}{shown}", param)


def _where(loc: tuple) -> tuple[str, str]:
    """(the parameter, the rest) of an error's location: the parameter ends at a union member's tag."""
    names = [f"[{p}]" if isinstance(p, int) else str(p) for p in loc]
    for i, part in enumerate(loc):
        if isinstance(part, str) and _TAG.search(part):
            return _join(names[:i]), _join(names[i + 1:])
    return _join(names), ""


def _join(names: list[str]) -> str:
    out = ""
    for n in names:
        out += n if n.startswith("[") or not out else f".{n}"
    return out


_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|[\[\]-]|^[A-Z]")
