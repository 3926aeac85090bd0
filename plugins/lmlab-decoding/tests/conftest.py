"""A bigram language model with a trivial inference cache, for decoding tests."""

import pytest
import torch

from lmlab.api import InferenceCache


class BigramModel(torch.nn.Module):
    """logits of the next token = table[current token]. Checks that callers respect its context."""

    def __init__(self, table: torch.Tensor, max_context: int | None = 64):
        super().__init__()
        self.table = torch.nn.Parameter(table)  # (V, V)
        self.vocab_size = table.shape[0]
        self.block_size = max_context or 1024
        self._max_context = max_context
        self.calls: list[int] = []  # tokens fed per call

    @property
    def max_context(self) -> int | None:
        return self._max_context

    def new_cache(self, batch_size: int, max_len: int) -> InferenceCache:
        assert self.max_context is None or max_len <= self.max_context
        return InferenceCache(states=[], max_len=max_len)

    def forward(self, idx: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        self.calls.append(idx.shape[1])
        if cache is not None:
            assert cache.length + idx.shape[1] <= cache.max_len, "cache overflow"
            cache.length += idx.shape[1]
        elif self.max_context is not None:
            assert idx.shape[1] <= self.max_context
        return self.table[idx]  # (B, T, V)


def greedy_chain(table: torch.Tensor, start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n):
        out.append(int(table[out[-1]].argmax()))
    return out[1:]


@pytest.fixture
def bigram():
    """Factory: bigram(table, max_context=64) → BigramModel."""
    return BigramModel


@pytest.fixture
def chain():
    """chain(table, start, n) → the n tokens greedy decoding must produce after ``start``."""
    return greedy_chain


@pytest.fixture
def table():
    """A random (V=16) bigram table whose rows have a clear argmax (top-2 margin > 0.05)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 16, generator=g) * 3
    top2 = t.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 0.05
    return t


class HistoryEngine:
    """``lmlab.api.Engine`` at its plainest: each row keeps its tokens, and every step runs the model
    over each row's whole history without a cache. An independent reference for the core's engines;
    it records every call (``steps``) and the longest row it was ever fed (``longest``)."""

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.vocab_size
        self.rows: dict[int, list[int]] = {}
        self.steps: list[tuple[int, int]] = []  # (rows, tokens per row) of each step call
        self.longest: dict[int, int] = {}  # row → the most tokens it ever held
        self._next = 0

    def _logits(self, row: int, last: int) -> torch.Tensor:
        device = next(self.model.parameters()).device
        idx = torch.tensor([self.rows[row]], dtype=torch.long, device=device)
        self.longest[row] = max(self.longest.get(row, 0), idx.shape[1])
        return self.model(idx)[0, -last:].float()  # (last, V)

    def _new(self, tokens: list[int]) -> int:
        self._next += 1
        self.rows[self._next - 1] = list(tokens)
        return self._next - 1

    def add(self, prompts):
        rows = [self._new(p) for p in prompts]
        return rows, torch.stack([self._logits(r, 1)[0] for r in rows])

    def step(self, rows, tokens):
        assert len(set(rows)) == len(rows) and tokens.shape[0] == len(rows)
        self.steps.append(tuple(tokens.shape))
        for r, t in zip(rows, tokens.tolist()):
            self.rows[r].extend(t)
        return torch.stack([self._logits(r, tokens.shape[1]) for r in rows])

    def rewind(self, rows, counts):
        for r, n in zip(rows, counts):
            assert 0 <= n <= len(self.rows[r])
            if n:
                del self.rows[r][-n:]

    def fork(self, rows):
        return [self._new(self.rows[r]) for r in rows]

    def assign(self, dst, src):
        copies = [list(self.rows[s]) for s in src]
        for d, c in zip(dst, copies):
            self.rows[d] = c

    def release(self, rows):
        for r in rows:
            del self.rows[r]

    def length(self, row):
        return len(self.rows[row])

    def companion(self, model):
        return HistoryEngine(model)


class Recorder:
    """``lmlab.api.Outputs`` as the core keeps it, over token ids: a prompt ends at ``eos_id`` (not
    recorded), after its limit, or once its tokens contain ``stop`` (a token sequence, kept, as a
    stop string's tokens are until the text is cut). ``offers`` holds what ``offer`` received."""

    def __init__(self, limits: list[int], eos_id: int | None = None, stop: list[int] | None = None):
        self.limits, self.eos_id, self.stop = limits, eos_id, stop
        self.tokens: list[list[int]] = [[] for _ in limits]
        self.finished = [False] * len(limits)
        self.offers: dict[int, list[tuple[list[int], float]]] = {}

    def max_new_tokens(self, i):
        return self.limits[i]

    def done(self, i):
        return self.finished[i]

    def _stopped(self, tokens):
        n = len(self.stop or ())
        return n > 0 and any(tokens[j:j + n] == self.stop for j in range(len(tokens) - n + 1))

    def ends(self, i, tokens):
        return len(tokens) >= self.limits[i] or (self.eos_id is not None and self.eos_id in tokens) or \
            self._stopped(tokens)

    def offer(self, i, candidates):
        self.offers[i] = [(list(t), float(s)) for t, s in candidates]

    def record(self, i, tokens):
        for t in tokens:
            if self.finished[i]:
                return
            if t == self.eos_id:
                self.finished[i] = True
                return
            self.tokens[i].append(t)
            self.finished[i] = len(self.tokens[i]) >= self.limits[i] or self._stopped(self.tokens[i])


def drive(decoder, engine, prompts, outputs, generator=None):
    """Run ``decoder.decode`` as the core does, recording what it yields; returns the yields."""
    yields = []
    with torch.no_grad():
        for made in decoder.decode(engine, prompts, outputs, generator):
            yields.append({i: list(t) for i, t in made.items()})
            for i, t in made.items():
                outputs.record(i, t)
    return yields


def reference_pair(V=11, d_model=32, n_layers=3, init_std=0.02, head_scale=1.0, seed=0):
    """A target (the kit's reference model, ``n_layers`` blocks, untied head of std ``head_scale``)
    and a smaller draft: the target's first block only, with its embedding, final norm and head
    (a layer-skipping draft: different logits, correlated with the target's)."""
    from torch import nn

    from lmlab.api import ModelShape
    from lmlab.testing import ReferencePosition, reference_model

    def build(layers):
        shape = ModelShape(n_layers=layers, d_model=d_model, n_heads=4, block_size=64, vocab_size=V,
                           init_std=init_std)
        model = reference_model(shape, ReferencePosition())
        model.head.weight = nn.Parameter(torch.empty(V, d_model))  # untie from the embedding
        return model

    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        target = build(n_layers)
        nn.init.normal_(target.head.weight, 0.0, head_scale)
        draft = build(1)
    keep = {k: v for k, v in target.state_dict().items() if not k.startswith("blocks.") or k.startswith("blocks.0.")}
    draft.load_state_dict(keep)
    return target.eval(), draft.eval()


@pytest.fixture
def history_engine():
    """HistoryEngine(model): a cache-free reference engine that records its calls."""
    return HistoryEngine


@pytest.fixture
def recorder():
    """Recorder(limits, eos_id=None, stop=None): the core's Outputs over token ids."""
    return Recorder


@pytest.fixture
def run_decode():
    """run_decode(decoder, engine, prompts, outputs, generator=None) → the list of yields."""
    return drive


@pytest.fixture
def models():
    """models(**kw) → (target, draft): reference models for speculative decoding (see reference_pair)."""
    return reference_pair
