"""The run's decoding plugin as ``lmlab serve`` uses it: the decoder chooses every token, and a
request's fields are its options.

A token-level decoder (``lmlab.api.TokenDecoder``: greedy, sample, a third party's) runs inside the
scheduler's continuous batching: each step calls its ``choose`` once over every running request,
each row with that request's options. A decoder that needs whole sequences (beam search, speculative
decoding) cannot take part in a step shared with other requests, and is refused when the server
starts.

The options a request may set are the decoder's own (its ``Options`` less the engine settings every
decoder shares, ``DecodingOptions``, which are the server's); a request that sets none decodes with
the server's values (the run's ``[decoding]`` table and ``--set decoding.*``). A field that is not
one of them is refused (400) naming it, except OpenAI's penalties and ``logit_bias`` at their
neutral value and ``null``, which ask for nothing, and ``temperature: 0`` (greedy) for a decoder that
always picks the most likely token (``TokenDecoder.picks_most_likely``).
"""

from typing import Any

import torch
from pydantic import ValidationError

from lmlab.api.decoding import DecodingOptions, TokenDecoder
from lmlab.errors import UserError
from lmlab.serve.protocol import ApiError, validation_error

# OpenAI fields a client may send at the value that changes nothing (LangChain sends the penalties).
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}


def servable(decoder) -> TokenDecoder:
    """``decoder``, or a UserError naming decoding.use when it is not token-level."""
    if not isinstance(decoder, TokenDecoder):
        raise UserError(f"{decoder.name!r} decodes whole sequences, which lmlab serve cannot batch with other "
                        "requests; serve with a token-level decoder (a plugin built on lmlab.api.TokenDecoder), "
                        "and use lmlab generate for this one", key="decoding.use")
    return decoder


class RequestOptions:
    """Turns a request's decoder fields into an instance of the decoder's ``Options``."""

    def __init__(self, decoder: TokenDecoder):
        self.decoder = servable(decoder)
        self.defaults = decoder.options
        self.fields = [name for name in type(self.defaults).model_fields if name not in DecodingOptions.model_fields]

    def __call__(self, given: dict[str, Any]):
        """The options for one request (the server's own object when it sets none), or an ApiError."""
        mine = {}
        neutral = {**NEUTRAL, **({"temperature": 0} if getattr(self.decoder, "picks_most_likely", False) else {})}
        for name, value in given.items():
            if name in self.fields:
                mine[name] = value
            elif value is not None and not (name in neutral and _same(value, neutral[name])):
                offered = ", ".join(self.fields) if self.fields else "none"
                raise ApiError(400, f"unknown parameter {name!r}: this server decodes with {self.decoder.name!r} "
                                    f"(decoding.use), whose options a request may set are: {offered}",
                               name, "unknown_parameter")
        if not mine:
            return self.defaults
        try:
            return type(self.defaults).model_validate({**dict(self.defaults), **mine})
        except ValidationError as exc:
            raise validation_error(exc) from None


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is not bool and value == neutral


def generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A seeded request's own generator (None: the server's shared one)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def engine_settings(options: DecodingOptions, overrides: list[str], cache: str | None) -> dict[str, Any]:
    """The server's cache settings from the decoder's engine options, each taking effect or refused
    (a UserError naming the key): ``--cache`` (``cache``, None when not given) wins over the run's
    recorded ``decoding.cache`` but must agree with a ``--set decoding.cache``."""
    for name in ("cuda_graph", "compile"):
        if getattr(options, name):
            # Both need a fixed batch of rows; the scheduler's changes at every admission and finish.
            raise UserError("lmlab serve steps a batch of requests that changes as they come and go, which a "
                            "captured or compiled fixed-shape step cannot follow; set it false to serve "
                            f"(--set decoding.{name}=false)", key=f"decoding.{name}")
    given = {o.partition("=")[0].strip() for o in overrides}
    if "decoding.cache" in given:
        if cache is not None and cache != options.cache:
            raise UserError(f"says {cache!r} but --set decoding.cache says {options.cache!r}; give one",
                            key="--cache")
        cache = options.cache
    return {"cache": cache or "paged", "block_size": options.block_size}
