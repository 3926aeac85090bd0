"""``lmlab serve``: OpenAI's completions and chat over HTTP, streamed or not, with continuous batching.

The server runs in this process (uvicorn in a thread, on a free port) over a tiny run trained once
for the module on Alpaca-style records (so it has a chat template); the real ``openai`` client and
plain httpx talk to it. Concurrent requests must each get exactly the text they get alone, while the
scheduler decodes them together.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from support import ROOT, refused, run_cli, serving, start_cli, wait_for

MODEL = "tiny-chat"

MANIFEST = """
name = "chat"
seed = 1

[data]
use = "alpaca"
path = "records.jsonl"
template = "compact"
response_end = "\\n"

[model]
n_layers = 2
d_model = 48
n_heads = 4
block_size = 64

[optimizer]
use = "adamw"
lr = 3e-3

[train]
max_steps = 150
batch_size = 8
warmup_steps = 10
eval_every = 150
checkpoint_every = 150
eval_steps = 2
log_every = 50
sample_tokens = 0

[tracker]
use = "none"
"""


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """A run folder trained (causal-lm, 150 steps) on instruction records in the compact template."""
    root = tmp_path_factory.mktemp("serve")
    rng = random.Random(0)
    records = []
    for i in range(200):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 8)))
        if i % 2:
            records.append({"instruction": "Reverse the word.", "input": word, "output": word[::-1]})
        else:
            records.append({"instruction": f"Say {word} twice.", "input": "", "output": f"{word} {word}"})
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "chat.toml").write_text(MANIFEST)
    done = run_cli("run", str(root / "chat.toml"), "--out", str(root / "runs"),
                   env={"LMLAB_CACHE": str(root / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    return root / "runs" / "default"


@pytest.fixture(scope="module")
def run(chat_run):
    from lmlab.trained import load_run

    return load_run(chat_run)


def sampler():
    """The sample plugin: requests' temperature, top_p and top_k are its options (0 is greedy)."""
    from lmlab import discovery

    return discovery.load("decoding", "sample")()


def make_service(run, **settings):
    from lmlab.serve.service import Service

    settings.setdefault("template", run.plugins["data"].chat_template())
    settings.setdefault("decoder", sampler())
    return Service(run.model, run.tokenizer, model_id=MODEL, data_name="alpaca", **settings)


@pytest.fixture(scope="module")
def server(run):
    service = make_service(run, max_batch=16)
    with serving(service) as url:
        yield service, url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def concurrently(ask, n: int) -> None:
    """ask(i) for i in range(n), each in its own client thread, all at once."""
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def sse(response: httpx.Response) -> list:
    """The events of a server-sent-event body: parsed JSON chunks, then the literal "[DONE]"."""
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: ") and "\n" not in block, block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


PROMPTS = [f"Instruction: Say {w} twice.\nResponse: " for w in
           ("abc", "cab", "hhga", "dead", "bee", "fade", "gag", "ach", "abcdefg", "hg", "fed", "cafe")] + \
          [f"Instruction: Reverse the word.\nInput: {w}\nResponse: " for w in ("abc", "hgfe", "dabbed", "gh")]


# -- routes, completions, streaming --------------------------------------------------------------------


def test_health_and_models_list_the_one_model(server):
    service, url = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    c = client(url)
    assert [m.id for m in c.models.list()] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL


def test_a_streamed_completion_joins_to_the_plain_one(server):
    service, url = server
    c = client(url)
    # As many new tokens as the 64-token context leaves after the prompt: up to its last position.
    prompt_tokens = len(service.encode(PROMPTS[0]))
    room = 64 - prompt_tokens
    plain = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=room, temperature=0)
    assert plain.object == "text_completion" and plain.model == MODEL
    (choice,) = plain.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens, plain.usage.total_tokens) == \
        (prompt_tokens, room, 64)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=room, temperature=0, stream=True))
    assert len(chunks) > 10 and all(ch.object == "text_completion" for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks) == choice.text
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_the_event_stream_is_data_lines_ending_with_done_and_can_carry_usage(server):
    service, url = server
    body = {"model": MODEL, "prompt": [PROMPTS[1]], "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse(response)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert len({ch["id"] for ch in chunks}) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    plain = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == plain["choices"][0]["text"]


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(server):
    service, url = server
    c = client(url)
    text = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=25, temperature=0).choices[0].text
    stop = text[4:6]  # two characters: streamed, the first must be held back until it is not a stop
    cut = text[:text.find(stop)]
    for stops in (stop, [stop, "zzz"]):
        done = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=25, temperature=0, stop=stops)
        assert (done.choices[0].text, done.choices[0].finish_reason) == (cut, "stop")
        chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=25, temperature=0, stop=stops,
                                           stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_at_temperature_one_gives_text_of_the_asked_length(server):
    service, url = server
    c = client(url)
    for top_p in (1.0, 0.5, 0.0):
        done = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=1, top_p=top_p, seed=7)
        assert done.usage.completion_tokens == 10
    # top_p 0 keeps only the most likely token: greedy
    greedy = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0).choices[0].text
    assert c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=1.5,
                                top_p=0).choices[0].text == greedy


# -- continuous batching ---------------------------------------------------------------------------------


def test_concurrent_requests_each_get_their_text_alone_and_are_decoded_together(server):
    service, url = server
    c = client(url)
    room = [64 - len(service.encode(p)) for p in PROMPTS]  # each request fills the context
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0].text
             for p, n in zip(PROMPTS, room)]
    assert len(set(alone)) > 1
    stats = service.scheduler.stats
    steps, largest = stats.steps, stats.largest_batch
    assert largest == 1
    together: list = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def ask(i: int) -> None:
        own = client(url)
        start.wait()
        if i % 2:  # half of them streamed
            chunks = own.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=room[i], temperature=0,
                                            stream=True)
            together[i] = "".join(ch.choices[0].text for ch in chunks)
        else:
            together[i] = own.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=room[i],
                                                 temperature=0).choices[0].text

    concurrently(ask, len(PROMPTS))
    assert together == alone
    assert stats.largest_batch > 1
    # Alone, the 16 requests take a decode step per token but their first; together far fewer.
    assert stats.steps - steps < sum(room) / 2, (stats.steps - steps, stats.largest_batch)


def test_a_request_joins_the_running_batch_and_a_closed_stream_frees_its_row(run):
    service = make_service(run, max_batch=4)
    scheduler = service.scheduler
    step = scheduler.engine.step

    def paced(*args):
        time.sleep(0.05)  # a long request fills the context in ~1.3 s, not ~30 ms: still running when looked at
        return step(*args)

    scheduler.engine.step = paced
    with serving(service) as url:
        c = client(url)
        short_alone = c.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=5, temperature=0).choices[0].text
        room = 64 - len(service.encode(PROMPTS[4]))
        body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": room, "temperature": 0, "stream": True}
        finished = scheduler.stats.finished
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as long:
            lines = long.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            steps = scheduler.stats.steps
            short = c.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=5, temperature=0)
            # The short request ran beside the long one, which is still decoding.
            assert (short.choices[0].text, short.choices[0].finish_reason) == (short_alone, "length")
            assert scheduler.running == 1 and scheduler.stats.largest_batch == 2
            assert scheduler.stats.steps > steps
            assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
        # The client went away: its row is given back and decoding stops, the request unfinished.
        deadline = time.monotonic() + 30
        while scheduler.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scheduler.running == 0 and scheduler.engine.rows_free == 4
        made = scheduler.stats.tokens
        time.sleep(0.2)
        assert scheduler.stats.tokens == made and scheduler.stats.finished == finished + 1  # the short one only
        # A client that stops waiting for a plain (not streamed) answer frees its row too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
        deadline = time.monotonic() + 30
        while (scheduler.running or scheduler.stats.tokens == made) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scheduler.running == 0 and scheduler.stats.tokens > made
        assert scheduler.stats.finished == finished + 1
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_the_paged_cache_admits_only_what_its_free_blocks_can_hold(run):
    # Two sequences' worth of blocks (64-token context, blocks of 16: 4 each) for 6 requests that
    # may each fill the context: at most two decode at once, the others wait for freed blocks.
    service = make_service(run, max_batch=8, cache="paged", n_blocks=8)
    prompts = PROMPTS[:6]
    with serving(service) as url:
        c = client(url)
        room = [64 - len(service.encode(p)) for p in prompts]
        alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0].text
                 for p, n in zip(prompts, room)]
        together: list = [None] * len(prompts)

        def ask(i: int) -> None:
            together[i] = client(url).completions.create(model=MODEL, prompt=prompts[i], max_tokens=room[i],
                                                         temperature=0).choices[0].text

        concurrently(ask, len(prompts))
        assert together == alone
        assert service.scheduler.stats.largest_batch == 2 and not service.scheduler.stats.failures
        assert service.scheduler.store.available() == 8


def test_the_contiguous_cache_serves_the_same_text(run, server):
    _, shared = server
    expected = client(shared).completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=20, temperature=0)
    with serving(make_service(run, max_batch=2, cache="contiguous")) as url:
        got = client(url).completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=20, temperature=0)
    assert got.choices[0].text == expected.choices[0].text


class Chars:
    """A character tokenizer over a fixed alphabet, without an end-of-text token."""

    eos_id = None

    def __init__(self, alphabet: str):
        self.alphabet, self.vocab_size = alphabet, len(alphabet)

    def encode(self, text):
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.alphabet[i] for i in ids)

    def chat_template(self):
        return None


def test_a_model_without_a_shared_cache_is_served_row_by_row_with_the_same_text():
    # mamba keeps its own state (no kv_layout): the scheduler drives a RowEngine, one Stepper a row.
    from lmlab import discovery
    from lmlab.api import ModelShape
    from lmlab.model import LanguageModel
    from lmlab.serve.protocol import CompletionRequest
    from lmlab.serve.service import Service

    torch.manual_seed(0)
    shape = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=32, vocab_size=10)
    plugins = {slot: discovery.load(slot, name)() for slot, name in
               (("attention", "mamba"), ("position", "none"), ("ffn", "mlp"))}
    service = Service(LanguageModel(shape, **plugins).eval(), Chars("abcdefgh \n"), model_id="m", max_batch=4,
                      decoder=sampler())
    assert type(service.scheduler.engine).__name__ == "RowEngine" and service.context == 32

    def complete(prompts: list[str]) -> list[str]:
        jobs = [service.scheduler.submit(service.completion_jobs(CompletionRequest(model="m", prompt=p, max_tokens=25,
                                                                                   temperature=0))[0])
                for p in prompts]
        deadline = time.monotonic() + 60
        while any(j.finished_step is None for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.005)
        return [j.completion.text for j in jobs]

    service.start()
    try:
        prompts = ["abc", "hg fe", "a", "bbbbb", "ab ab", "h"]
        alone = [complete([p])[0] for p in prompts]
        assert complete(prompts) == alone and len(set(alone)) > 1
        assert service.scheduler.stats.largest_batch == 4
    finally:
        service.stop()


# -- chat ----------------------------------------------------------------------------------------------


def test_chat_renders_the_runs_template_and_stops_where_training_taught(server):
    service, url = server
    c = client(url)
    messages = [{"role": "system", "content": "hgfe"}, {"role": "user", "content": "Reverse the word."}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert chat.object == "chat.completion"
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    # The same as a completion of the template's prompt, cut at its stop ("\n", the response end).
    prompt = "Instruction: Reverse the word.\nInput: hgfe\nResponse: "
    completion = c.completions.create(model=MODEL, prompt=prompt, max_tokens=64 - len(service.encode(prompt)),
                                      temperature=0, stop="\n")
    assert choice.message.content == completion.choices[0].text and "\n" not in choice.message.content
    assert chat.usage.prompt_tokens == len(service.encode(prompt))
    # Streamed: the role first, then the content, then the finish reason.
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Without a system message, the template's prompt without input; only the last user turn counts.
    alone = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say bad twice."}],
                                      temperature=0, max_tokens=8)
    later = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "Reverse the word."}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": "Say bad "}, {"type": "text", "text": "twice."}]}])
    direct = c.completions.create(model=MODEL, prompt="Instruction: Say bad twice.\nResponse: ", max_tokens=8,
                                  temperature=0, stop="\n")
    assert alone.choices[0].message.content == later.choices[0].message.content == direct.choices[0].text


def test_chat_is_refused_naming_the_missing_template_on_a_run_without_one(run):
    with serving(make_service(run, max_batch=2, template=None)) as url:
        with pytest.raises(openai.BadRequestError) as refused:
            client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 400 and refused.value.code == "chat_template_missing"
        assert "chat template" in refused.value.message and "alpaca" in refused.value.message
        assert client(url).completions.create(model=MODEL, prompt="Say", max_tokens=3).usage.completion_tokens == 3


def test_the_alpaca_runs_folder_serves_its_template_and_name(chat_run):
    from lmlab.serve.service import Service

    service = Service.from_run(chat_run, max_batch=2)
    assert service.model_id == "default" and service.context == 64
    assert service.template.render("Do it.", "x") == "Instruction: Do it.\nInput: x\nResponse: "
    assert service.template.stop == "\n" and service.data_name == "alpaca"


# -- bad requests ---------------------------------------------------------------------------------------

LONG = "Instruction: " + "abc " * 20  # 93 characters: past the 64-token context

BAD = [
    # (route, body, status, param, code)
    ("completions", b"{\"model\": ", 400, None, "invalid_json"),
    ("completions", b"[1, 2]", 400, None, None),
    ("completions", {"prompt": "Say"}, 400, "model", None),
    ("completions", {"model": "gpt-4", "prompt": "Say"}, 404, "model", "model_not_found"),
    ("completions", {"model": MODEL}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": "Say", "max_tokens": 0}, 400, "max_tokens", None),  # without echo
    ("completions", {"model": MODEL, "prompt": "Say", "max_tokens": -3}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "Say", "max_tokens": "5"}, 400, "max_tokens", None),
    ("completions", {"model": MODEL, "prompt": "Say", "n": 17}, 400, "n", None),
    ("completions", {"model": MODEL, "prompt": "Say", "n": 2, "stream": True}, 400, "stream", None),
    ("completions", {"model": MODEL, "prompt": "Say", "best_of": 3}, 400, "best_of", None),
    ("completions", {"model": MODEL, "prompt": "Say", "temperature": "hot"}, 400, "temperature", None),
    ("completions", {"model": MODEL, "prompt": "Say", "temperature": -1}, 400, "temperature", None),
    ("completions", {"model": MODEL, "prompt": "Say", "top_k": 0}, 400, "top_k", None),
    ("completions", {"model": MODEL, "prompt": "Say", "seed": 2**64}, 400, "seed", None),
    # a field that is no option of the server's decoder (sample) is refused naming it, never ignored
    ("completions", {"model": MODEL, "prompt": "Say", "min_p": 0.1}, 400, "min_p", "unknown_parameter"),
    ("completions", {"model": MODEL, "prompt": "Say", "presence_penalty": 0.5}, 400, "presence_penalty",
     "unknown_parameter"),
    ("completions", {"model": MODEL, "prompt": "Say", "cache": "paged"}, 400, "cache", "unknown_parameter"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "min_p": 0.1}, 400,
     "min_p", "unknown_parameter"),
    ("completions", {"model": MODEL, "prompt": "Say", "top_p": 1.5}, 400, "top_p", None),
    ("completions", {"model": MODEL, "prompt": "Say", "stop": ""}, 400, "stop", None),
    ("completions", {"model": MODEL, "prompt": "Say", "stop": ["\n", ""]}, 400, "stop", None),
    ("completions", {"model": MODEL, "prompt": ["Say", "Do"], "stream": True}, 400, "stream", None),
    ("completions", {"model": MODEL, "prompt": [1, 10**6]}, 400, "prompt", "invalid_prompt"),
    ("completions", {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": "Say", "logprobs": 21}, 400, "logprobs", None),
    ("completions", {"model": MODEL, "prompt": "Say", "logprobs": 1, "stream": True}, 400, "stream", None),
    ("completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": LONG, "stream": True}, 400, "prompt", "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "\u20ac"}, 400, "prompt", "invalid_prompt"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role",
     None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                                       {"role": "assistant", "content": "y"}]}, 400, "messages", None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context_length_exceeded"),
    ("chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}], "stream": True}, 404,
     "model", "model_not_found"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400,
     "top_logprobs", None),
    # max_tokens past what the context leaves: refused, not decoded for ever (10**30 is a valid JSON integer)
    ("completions", {"model": MODEL, "prompt": "Say", "max_tokens": 10**30}, 400, "max_tokens",
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "Say", "max_tokens": 62}, 400, "max_tokens", "context_length_exceeded"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Say"}], "max_tokens": 10**30},
     400, "max_tokens", "context_length_exceeded"),
    # nested past what json (RecursionError) or pydantic parse, and a body bigger than any prompt that fits
    ("completions", b"[" * 100_000 + b"]" * 100_000, 400, None, "invalid_json"),
    ("completions", b'{"model": "x", "stop": ' + b"[" * 500 + b"]" * 500 + b"}", 400, None, "invalid_json"),
    ("completions", b'{"model": "x", "prompt": "' + b"a" * (1 << 20) + b'"}', 413, None, "request_too_large"),
]


@pytest.mark.parametrize("route, body, status, param, code", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_the_openai_error_object_and_the_server_goes_on(server, route, body, status, param, code):
    service, url = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{url}/v1/{route}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert client(url).completions.create(model=MODEL, prompt="Say", max_tokens=2).usage.completion_tokens == 2


def test_the_openai_client_sees_refusals_as_its_own_errors(server):
    _, url = server
    c = client(url)
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="gpt-4", prompt="Say", max_tokens=2)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError) as long:
        c.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
    assert long.value.code == "context_length_exceeded" and "64" in long.value.message
    for path, method in (("/v1/nothing", "GET"), ("/v1/completions", "GET")):
        response = httpx.request(method, f"{url}{path}")
        assert response.status_code in (404, 405) and set(response.json()["error"]) == {"message", "type", "param",
                                                                                         "code"}


# -- sampling -------------------------------------------------------------------------------------------


def test_a_seed_makes_a_request_reproducible_whatever_is_decoded_beside_it(server):
    _, url = server
    c = client(url)

    def ask(seed: int) -> str:
        return c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=20, temperature=1.5,
                                    seed=seed).choices[0].text

    alone = ask(11)
    beside: list[str] = []
    noise = threading.Thread(target=lambda: concurrently(lambda i: ask(100 + i), 3))
    noise.start()
    beside.append(ask(11))
    noise.join(120)
    assert beside == [alone] and ask(11) == alone
    assert len({alone, *(ask(s) for s in (12, 13, 14))}) > 1  # the seed is what fixed it
    # neutral OpenAI fields and nulls ask for nothing
    assert c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=20, temperature=1.5, seed=11,
                                presence_penalty=0, frequency_penalty=0, extra_body={"top_k": None}
                                ).choices[0].text == alone


# -- the command --------------------------------------------------------------------------------------


def test_lmlab_serve_prints_its_url_answers_and_exits_130_on_ctrl_c_without_a_traceback(chat_run, tmp_path):
    assert run_cli("serve", str(tmp_path)).returncode == 2  # not a run folder
    before = {f: f.read_bytes() for f in chat_run.rglob("*") if f.is_file()}
    # Three times (a traceback came in one run of two): streams in flight when Ctrl-C comes, one
    # run keyed by the environment, one by the flag; the key never shows in output or the run folder.
    for attempt, (args, env) in enumerate([((), {}), ((), {"LMLAB_API_KEY": "k-env-31337"}),
                                           (("--api-key", "k-flag-31337"), {})]):
        key = args[1] if args else env.get("LMLAB_API_KEY")
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        proc = start_cli("serve", str(chat_run), "--port", "0", "--model-name", "mine", "--max-batch", "4", *args,
                         env=env, stdout=subprocess.PIPE)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        try:
            wait_for(lambda: any("http://" in line for line in lines), proc, timeout=120, what="the URL")
            base = next(line for line in lines if "http://" in line).split()[2]
            assert base.startswith("http://127.0.0.1:") and base.endswith("/v1")
            assert [m.id for m in openai.OpenAI(base_url=base, api_key=key or "unused").models.list()] == ["mine"]
            if key:
                assert httpx.get(f"{base}/models", timeout=10).status_code == 401
            stop = threading.Event()

            def ask() -> None:  # streams until Ctrl-C, at most 30 requests or 60 s
                deadline = time.monotonic() + 60
                for _ in range(30):
                    if stop.is_set() or time.monotonic() > deadline:
                        return
                    with contextlib.suppress(httpx.HTTPError):
                        httpx.post(f"{base}/completions", headers=auth, timeout=30, json={
                            "model": "mine", "prompt": "Say", "max_tokens": 60, "stream": True})

            askers = [threading.Thread(target=ask, daemon=True) for _ in range(3)]
            for t in askers:
                t.start()
            time.sleep(0.3 + 0.2 * attempt)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 130
            stop.set()
            err = proc.stderr.read()
            assert "Traceback" not in err and "lmlab: interrupted (Ctrl-C)" in err, err[-3000:]
            if key:
                assert key not in err and key not in "".join(lines)
            for t in askers:
                t.join(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    after = {f: f.read_bytes() for f in chat_run.rglob("*") if f.is_file()}
    assert after == before  # serving writes nothing into the run, the keys least of all


def test_a_scheduler_that_stopped_refuses_late_and_unstarted_requests_at_once(run):
    # What hung a stream past uvicorn's graceful shutdown (then a traceback): a request submitted
    # after the loop ended, or left in its inbox, never heard back.
    import asyncio

    service = make_service(run, max_batch=2)
    scheduler = service.scheduler
    from lmlab.serve.protocol import CompletionRequest

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [service.completion_jobs(CompletionRequest(model=MODEL, prompt="Say", max_tokens=5))[0] for _ in range(2)]
        for job in jobs:
            job.loop, job.events = loop, asyncio.Queue()
        scheduler.stop()  # no thread to join: only queues the stop
        scheduler.submit(jobs[0])  # behind the stop: never taken
        await loop.run_in_executor(None, scheduler.run)
        scheduler.submit(jobs[1])  # after the loop ended
        return [await asyncio.wait_for(job.events.get(), timeout=10) for job in jobs]

    assert asyncio.run(main()) == [("error", "the server is shutting down")] * 2


@pytest.mark.parametrize("where", ["prefill", "finish"])
def test_ctrl_c_anywhere_in_the_loop_still_answers_every_request_it_took(run, monkeypatch, where):
    # Ctrl-C landing in a prefill (requests out of the waiting line, not yet live) or between a
    # request leaving the live rows and its "done" left those streams waiting until uvicorn's
    # shutdown timeout cancelled them, with a traceback (a CI run of the Ctrl-C test).
    import asyncio

    from lmlab.serve.protocol import CompletionRequest

    service = make_service(run, max_batch=2)
    scheduler = service.scheduler

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(*((scheduler.engine, "add") if where == "prefill" else (scheduler, "_finish")), interrupt)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [service.completion_jobs(CompletionRequest(model=MODEL, prompt="Say", max_tokens=1))[0] for _ in range(2)]
        for job in jobs:
            job.loop, job.events = loop, asyncio.Queue()
            scheduler.submit(job)
        with pytest.raises(KeyboardInterrupt):
            await loop.run_in_executor(None, scheduler.run)
        return [await asyncio.wait_for(job.events.get(), timeout=10) for job in jobs]

    assert asyncio.run(main()) == [("error", "the server is shutting down")] * 2


def test_a_job_past_the_context_is_never_submitted(run):
    from lmlab.serve.protocol import CompletionRequest

    service = make_service(run, max_batch=2)
    (job,) = service.completion_jobs(CompletionRequest(model=MODEL, prompt="Say", max_tokens=61))
    assert len(job.ids) + job.max_tokens == service.context == 64
    job.max_tokens = 62
    with pytest.raises(ValueError, match="context"):
        service.scheduler.submit(job)


def test_a_key_guards_every_route_and_is_compared_in_full(run):
    with serving(make_service(run, max_batch=2), api_key="s3cret") as url:
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/nothing")):
            for headers in ({}, {"Authorization": "Bearer s3cre"}, {"Authorization": "Bearer s3cret2"},
                            {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
                response = httpx.request(method, f"{url}{path}", headers=headers, timeout=10,
                                         json={"model": MODEL, "prompt": "Say", "max_tokens": 1})
                assert response.status_code == 401, (path, headers, response.text)
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key" and set(error) == {"message", "type", "param", "code"}
                assert response.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{url}/health", headers={"Authorization": "bearer s3cret"}).json() == {"status": "ok"}
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert keyed.completions.create(model=MODEL, prompt="Say", max_tokens=3).usage.completion_tokens == 3
        chunks = list(keyed.completions.create(model=MODEL, prompt="Say", max_tokens=3, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"


def test_listening_beyond_this_machine_without_a_key_warns():
    from lmlab.serve.app import exposure_warning

    for host in ("127.0.0.1", "127.0.0.5", "localhost", "::1", "[::1]"):
        assert exposure_warning(host, None) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.20"):
        warning = exposure_warning(host, None)
        assert "\n" not in warning and host in warning and "--api-key" in warning and "LMLAB_API_KEY" in warning
        assert exposure_warning(host, "k") is None


def test_bad_serve_options_are_refused_in_one_line_before_anything_starts(chat_run):
    refused(run_cli("serve", str(chat_run), "--port", "0", "--max-batch", str(10**9)), "--max-batch")
    refused(run_cli("serve", str(chat_run), "--port", "0", "--api-key", ""), "--api-key")
    refused(run_cli("serve", str(chat_run), "--port", "0", "--api-key", "two words"), "--api-key")


def test_the_cache_estimate_is_what_the_engine_allocates(run):
    from lmlab.serve.memory import cache_bytes

    for cache, n_blocks in (("paged", None), ("paged", 5), ("contiguous", None)):
        service = make_service(run, max_batch=3, cache=cache, n_blocks=n_blocks)
        store = service.scheduler.store
        allocated = sum(t.nbytes for t in [*store.k, *store.v])
        assert cache_bytes(run.model, 3, service.context, cache, 16, n_blocks) == allocated > 0, cache


def test_plugins_and_check_import_nothing_of_the_server():
    probe = ("import sys; from lmlab.cli.main import main; main(['plugins']); "
             f"main(['check', {str(ROOT / 'experiments' / 'shakespeare-char.toml')!r}, '-q']); "
             "print('IMPORTED', sorted(m for m in sys.modules if m.startswith('lmlab.serve') "
             "or m.split('.')[0] in ('fastapi', 'uvicorn', 'starlette')))")

    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "IMPORTED []"


# -- the decoding slot --------------------------------------------------------------------------------

MIN_P = '''
"""Min-p sampling (Nguyen et al. 2024, https://arxiv.org/abs/2407.01082), written against lmlab.api only."""

from lmlab.api import DecodingOptions, Field, TokenDecoder


class MinPOptions(DecodingOptions):
    temperature: float = Field(1.0, gt=0, help="divides the logits before the cut")
    min_p: float = Field(0.1, ge=0, le=1, help="keep the tokens at least this share as likely as the most likely")


class MinP(TokenDecoder):
    Options = MinPOptions

    def choose(self, logits, rows):
        probs = (logits / rows.values("temperature")[:, None]).softmax(dim=-1)
        floor = rows.values("min_p")[:, None] * probs.amax(dim=-1, keepdim=True)
        return rows.sample(probs.masked_fill(probs < floor, 0.0))
'''


def test_a_third_party_min_p_decoder_is_what_lmlab_serve_decodes_with(chat_run, server, tmp_path):
    from test_discovery import fake_dist

    site = tmp_path / "site"
    fake_dist(site, "lmlab-min-p", "lmlab_min_p", MIN_P, {"lmlab.decoding": {"min-p": "lmlab_min_p:MinP"}})
    _, url = server
    greedy = [client(url).completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0).choices[0].text
              for p in PROMPTS[:3]]
    proc = start_cli("serve", str(chat_run), "--port", "0", "--model-name", MODEL, "--set", "decoding.use=min-p",
                     "--set", "decoding.temperature=2.0", stdout=subprocess.PIPE,
                     env={"PYTHONPATH": str(site), "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        wait_for(lambda: any("http://" in line for line in lines), proc, timeout=120, what="the URL")
        assert "by 'min-p'; requests may set temperature, min_p" in "".join(lines)
        c = openai.OpenAI(base_url=next(line for line in lines if "http://" in line).split()[2], api_key="unused",
                          max_retries=0, timeout=60)

        def ask(prompt: str, **fields) -> str:
            return c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, extra_body=fields).choices[0].text

        # min_p 1.0 keeps only the most likely token: greedy, whatever the seed or the server's temperature
        assert [ask(p, seed=5, min_p=1.0) for p in PROMPTS[:3]] == greedy
        assert ask(PROMPTS[0], seed=6, min_p=1.0, temperature=0.5) == greedy[0]
        # min_p 0.0 samples the whole distribution (at the server's --set temperature 2.0): not greedy, but seeded
        sampled = [ask(p, seed=5, min_p=0.0) for p in PROMPTS[:3]]
        assert sampled != greedy and [ask(p, seed=5, min_p=0.0) for p in PROMPTS[:3]] == sampled
        # the sample plugin's top_p is no option of min-p: refused naming it
        with pytest.raises(openai.BadRequestError) as bad:
            ask(PROMPTS[0], top_p=0.5)
        assert bad.value.param == "top_p" and "'min-p'" in bad.value.message and "min_p" in bad.value.message
        with pytest.raises(openai.BadRequestError) as bad:
            ask(PROMPTS[0], min_p=1.5)
        assert bad.value.param == "min_p"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("overrides, key", [
    (["decoding.use=beam"], "decoding.use"),
    (["decoding.use=speculative", "decoding.draft={run}", "decoding.temperature=0"], "decoding.use"),
    (["decoding.cuda_graph=true"], "decoding.cuda_graph"),
    (["decoding.compile=true"], "decoding.compile"),
    (["architecture.exit_threshold=0.5"], "architecture.exit_threshold"),  # the run has no exit heads
    (["decoding.use=sample", "decoding.temprature=0.5"], "decoding.temprature"),
], ids=lambda v: v if isinstance(v, str) else v[-1])
def test_serve_refuses_decoding_settings_it_cannot_honour_in_one_line(chat_run, overrides, key):
    args = [a for o in overrides for a in ("--set", o.format(run=chat_run))]
    line = refused(run_cli("serve", str(chat_run), "--port", "0", *args), key)
    assert "Traceback" not in line


def test_the_decoding_cache_set_for_serve_takes_effect_or_is_refused(chat_run):
    from lmlab.serve.decoding import engine_settings
    from lmlab.trained import load_run

    options = load_run(chat_run, ["decoding.cache=contiguous", "decoding.block_size=8"]).plugins["decoding"].options
    # the run's recorded cache (contiguous, the generate default) does not override serve's paged default...
    assert engine_settings(options, [], None) == {"cache": "paged", "block_size": 8}
    assert engine_settings(options, [], "contiguous")["cache"] == "contiguous"
    # ...but --set decoding.cache does, and must agree with --cache
    assert engine_settings(options, ["decoding.cache=contiguous"], None)["cache"] == "contiguous"
    refused(run_cli("serve", str(chat_run), "--port", "0", "--cache", "paged", "--set", "decoding.cache=contiguous"),
            "--cache")


# -- what evaluation clients send (issue 40) ------------------------------------------------------------

def model_logprobs(run, ids: list[int]) -> torch.Tensor:
    """(T, V) log-probabilities of each next token, the model run on ``ids`` without a cache."""
    with torch.no_grad():
        return torch.log_softmax(run.model(torch.tensor([ids])).float()[0], dim=-1)


def test_echo_with_no_new_token_scores_the_prompt_as_the_model_does(server, run):
    _, url = server
    prompt = PROMPTS[0]
    ids = run.tokenizer.encode(prompt).tolist()
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    (choice,) = reply.choices
    assert choice.text == prompt and choice.finish_reason == "length" and reply.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    expected = model_logprobs(run, ids)
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(float(expected[t - 1, ids[t]]), abs=1e-4)
        top = expected[t - 1].topk(3)
        assert sorted(lp.top_logprobs[t].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert "".join(lp.tokens) == prompt and lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]


def test_new_tokens_carry_the_models_log_probabilities(server, run):
    _, url = server
    reply = client(url).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2)
    (choice,) = reply.choices
    ids = run.tokenizer.encode(PROMPTS[1]).tolist()
    made = run.tokenizer.encode(choice.text).tolist()  # the char tokenizer: one token per character
    expected = model_logprobs(run, ids + made)
    for i, token in enumerate(made):
        position = len(ids) + i - 1
        assert choice.logprobs.token_logprobs[i] == pytest.approx(float(expected[position, token]), abs=1e-4)
        best = max(choice.logprobs.top_logprobs[i].values())
        assert best == pytest.approx(choice.logprobs.token_logprobs[i], abs=1e-6)  # greedy: the chosen is the top
    echoed = client(url).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2,
                                            echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + choice.text
    assert echoed.choices[0].logprobs.token_logprobs[len(ids):] == pytest.approx(choice.logprobs.token_logprobs)


def test_several_prompts_token_ids_and_n_copies_come_back_as_indexed_choices(server, run):
    _, url = server
    c = client(url)
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in PROMPTS[:3]]
    batch = c.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1, 2] and [ch.text for ch in batch.choices] == alone
    ids = [run.tokenizer.encode(p).tolist() for p in PROMPTS[:2]]
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [ch.text for ch in by_ids.choices] == alone[:2]
    assert c.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0).choices[0].text == alone[0]
    # n samples of one prompt: reproducible with a seed, not all the same at temperature 1.
    many = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=4, seed=7)
    again = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=4, seed=7)
    texts = [ch.text for ch in many.choices]
    assert texts == [ch.text for ch in again.choices] and len(set(texts)) > 1
    assert many.usage.prompt_tokens == len(run.tokenizer.encode(PROMPTS[0]))
    other = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=4, seed=8)
    assert [ch.text for ch in other.choices] != texts


def test_chat_answers_carry_logprobs_and_n_copies(server):
    _, url = server
    messages = [{"role": "user", "content": "Say abc twice."}]
    reply = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2, n=2)
    assert [ch.index for ch in reply.choices] == [0, 1]
    first, second = reply.choices
    assert first.message.content == second.message.content
    content = first.logprobs.content
    assert "".join(t.token for t in content).startswith(first.message.content)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


def test_a_greedy_server_takes_temperature_zero_and_refuses_any_other(run):
    from lmlab import discovery

    service = make_service(run, decoder=discovery.load("decoding", "greedy")())
    with serving(service) as url:
        c = client(url)
        reply = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert reply.choices[0].text == c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4).choices[0].text
        with pytest.raises(openai.BadRequestError, match="temperature"):
            c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0.7)
