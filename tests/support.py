"""Helpers shared by the core's tests (importable: pytest puts tests/ on sys.path)."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: int = 300):
    """The real `python -m lmlab` in a subprocess (one thread: the machine has two cores)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


def random_llama(**config):
    """A tiny LlamaForCausalLM with seeded random weights, its norms' scales drawn away from one (HF
    initialises them to one, where a mistake in applying them would not show)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def refused(result, key: str) -> str:
    """The one error line of a command stopped by bad input, which must name ``key``."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"lmlab: error: {key}:"), result.stderr
    return errors[0]


def start_cli(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """The real `python -m lmlab` started in a subprocess (one thread), stderr captured as text."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "lmlab", *args], env=full_env, text=True, **popen)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 180, what: str = "the condition"):
    """Poll ``condition()`` until it holds; fails when ``proc`` ends first or time runs out."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (exit {proc.returncode}) before {what}: "
                                 f"{proc.communicate()[1][-2000:] if proc.stderr else ''}")
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout}s")


def logged_steps(metrics: Path) -> list[int]:
    """The steps of metrics.jsonl's complete training lines."""
    import json

    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()
            if line.endswith("}") and "train_loss" in line]


def completed_run(manifest: Path, out: Path, *args: str) -> dict:
    """Train ``manifest`` into ``out`` through the CLI (no closing sample); its summary.json."""
    import json

    result = run_cli("run", str(manifest), "--out", str(out), "--set", "train.sample_tokens=0", *args)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((out / "default" / "summary.json").read_text())


class StopAfter:
    """A progress listener that interrupts the preparation at the n-th ``event``, like Ctrl-C."""

    def __init__(self, event: str, n: int):
        self.event, self.n = event, n

    def __call__(self, event: str, info: dict) -> None:
        if event == self.event:
            self.n -= 1
            if self.n == 0:
                raise KeyboardInterrupt


def small_char_manifest(path: Path, tables: str) -> str:
    """Writes a one-layer, width-16 char-tokenizer manifest (4 steps of 4 rows of 16 tokens, no sample,
    no tracker) with ``tables`` (its [data] and anything else) to ``path``; returns the path."""
    path.write_text("""\
name = "curriculum"
[tokenizer]
use = "char"
[model]
n_layers = 1
n_heads = 2
d_model = 16
block_size = 16
[train]
max_steps = 4
batch_size = 4
eval_every = 4
eval_steps = 1
sample_tokens = 0
[tracker]
use = "none"
""" + tables)
    return str(path)


def hf_folder(root, text: str, tie: bool = False, shard: bool = False, chat_template: str | None = None,
              positions: int = 64):
    """A tiny random LlamaForCausalLM saved by save_pretrained, with a byte-level BPE tokenizer trained
    here on ``text`` (what a user's downloaded model folder holds, at toy size); with ``chat_template``,
    the tokenizer has ChatML's <|im_start|> and <|im_end|> and that template."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<s>", "</s>", *(["<|im_start|>", "<|im_end|>"] if chat_template else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = random_llama(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=tie)
    folder = root / "hf-llama"
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": "60KB"} if shard else {}))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return folder, model


@contextlib.contextmanager
def serving(service, api_key: str | None = None):
    """The app on a free port of 127.0.0.1 in a background thread; yields its base URL."""
    import threading
    import time

    import httpx
    import uvicorn

    from lmlab.serve.app import create_app, listen

    sock = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(service, api_key=api_key), log_level="warning"))
    auth = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5, headers=auth).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
