"""The engine of an encoder–decoder model (``EncoderDecoderModel.make_engine``): each prompt goes through
the encoder once, and the decoder generates from the model's decoder start id (``lmlab.api.Engine``, so
every decoding plugin works).

The decoder's self-attention uses the core's shared key/value store (``SharedCacheEngine``) unchanged.
Beside it, each row keeps its cross-attention keys and values, one pair per decoder layer
(``CrossAttentionModule.memory_kv`` of the encoder's output, computed when the row is added), and the
padding of its prompt; a forward pass hands the rows it feeds their slices of those. Forking or
assigning a row (beam search) copies them with the self-attention cache.
"""

import torch

from lmlab.api.decoding import SharedCacheEngine, engine_supports_rows


def seq2seq_engine(model, rows: int, max_len: int, **settings) -> "Seq2SeqEngine":
    """The engine for up to ``rows`` prompts of ``model`` and their continuations of up to ``max_len`` tokens."""
    if not engine_supports_rows(model):
        raise ValueError("an encoder-decoder model decodes through the shared key/value cache, which its "
                         "attention and position plugins must support (kv_layout, per_row)")
    return Seq2SeqEngine(model, rows, max_len, **settings)


class EncoderRows:
    """Engine methods for up to ``rows`` prompts read by the encoder, and their continuations of up to
    ``max_len`` tokens; mixed in before ``SharedCacheEngine``."""

    def __init__(self, model, rows: int, max_len: int, **settings):
        settings["cuda_graph"] = settings["compile"] = False  # the static step knows no cross-attention
        super().__init__(model, rows, max_len, **settings)
        self.start_id = model.decoder_start_id
        self.encoder_limit = model.enc_position.max_positions
        self.keys: list[torch.Tensor] = []  # per decoder layer: (rows, Hkv, S, hs), S growing with the longest prompt
        self.values: list[torch.Tensor] = []
        self.memory_padding = torch.ones(rows, 0, dtype=torch.bool, device=self.device)  # True: no prompt token
        self.prompt_lengths = [0] * rows
        self.cache.cross = self.cache.memory_padding = None

    def add(self, prompts: list[list[int]]) -> tuple[list[int], torch.Tensor]:
        if len(prompts) > len(self.free_rows):
            raise RuntimeError(f"{len(prompts)} new sequences, {len(self.free_rows)} free rows")
        if any(not ids for ids in prompts):
            raise ValueError("a prompt needs at least one token")
        limit = self.encoder_limit
        kept = [list(ids)[-limit:] if limit is not None else list(ids) for ids in prompts]  # the encoder's window
        S = max(len(ids) for ids in kept)
        ids = torch.zeros(len(kept), S, dtype=torch.long, device=self.device)
        padding = torch.ones(len(kept), S, dtype=torch.bool, device=self.device)
        for i, row in enumerate(kept):
            ids[i, :len(row)] = torch.tensor(row, device=self.device)
            padding[i, :len(row)] = False
        memory = self.model.encode(ids, padding)                                     # (n, S, C)
        rows = [self.free_rows.pop() for _ in prompts]
        self._grow(S)
        index = torch.tensor(rows, device=self.device)
        for layer, block in enumerate(self.model.blocks):
            k, v = block.cross.memory_kv(memory)
            self.keys[layer][index, :, :S] = k.to(self.keys[layer].dtype)
            self.values[layer][index, :, :S] = v.to(self.values[layer].dtype)
        self.memory_padding[index] = True
        self.memory_padding[index, :S] = padding
        for row, n in zip(rows, (len(r) for r in kept)):
            self.prompt_lengths[row] = n
        start = torch.full((len(rows), 1), self.start_id, dtype=torch.long, device=self.device)
        logits = self.forward_rows(rows, start)[:, -1]
        for row in rows:
            self.history[row] = [self.start_id]
        return rows, logits

    def assign(self, dst: list[int], src: list[int]) -> None:
        super().assign(dst, src)
        pairs = [(d, s) for d, s in zip(dst, src) if d != s]
        if not pairs:
            return
        d = torch.tensor([p[0] for p in pairs], device=self.device)
        s = torch.tensor([p[1] for p in pairs], device=self.device)
        for keys, values in zip(self.keys, self.values):
            keys[d], values[d] = keys[s], values[s]
        self.memory_padding[d] = self.memory_padding[s]
        for dst_row, src_row in pairs:
            self.prompt_lengths[dst_row] = self.prompt_lengths[src_row]

    def release(self, rows: list[int]) -> None:
        super().release(rows)
        for row in rows:
            self.prompt_lengths[row] = 0

    def _grow(self, S: int) -> None:
        """Room for prompts of S tokens in every row's cross-attention keys and values."""
        have = self.memory_padding.shape[1]
        if S <= have:
            return
        rows = self.memory_padding.shape[0]
        p = self.model.head.weight
        grown_padding = torch.ones(rows, S, dtype=torch.bool, device=self.device)
        grown_padding[:, :have] = self.memory_padding
        self.memory_padding = grown_padding
        if not self.keys:
            for block in self.model.blocks:
                heads, dim = block.cross.n_kv_heads, block.cross.head_dim
                self.keys.append(torch.zeros(rows, heads, 0, dim, device=self.device, dtype=p.dtype))
                self.values.append(torch.zeros(rows, heads, 0, dim, device=self.device, dtype=p.dtype))
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            self.keys[i] = torch.cat([k, k.new_zeros(rows, k.shape[1], S - have, k.shape[3])], dim=2)
            self.values[i] = torch.cat([v, v.new_zeros(rows, v.shape[1], S - have, v.shape[3])], dim=2)

    def forward_rows(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        # The rows' encoder keys and values, cut to the longest of their prompts.
        lengths = [self.prompt_lengths[r] for r in rows]
        S = max(lengths)
        # Rows 0..B-1 in order (the usual decode step) read views; any other set, one gather per layer.
        index = slice(0, len(rows)) if rows == list(range(len(rows))) else torch.tensor(rows, device=self.device)
        self.cache.cross = [(k[index, :, :S], v[index, :, :S]) for k, v in zip(self.keys, self.values)]
        # Whether any row is padded is known on the host: no device sync per step.
        self.cache.memory_padding = self.memory_padding[index, :S] if min(lengths) < S else None
        try:
            return super().forward_rows(rows, tokens)
        finally:
            self.cache.cross = self.cache.memory_padding = None


class Seq2SeqEngine(EncoderRows, SharedCacheEngine):
    """The engine of an encoder–decoder model: the core's shared-cache engine with the encoder's rows."""
