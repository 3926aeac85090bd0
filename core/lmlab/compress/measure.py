"""What a compressed run's summary reports, measured the same way for the run it came from, in the same
process: validation loss over the whole validation split (the windows of the run's own final
evaluation), bytes on disk and in memory, and generation speed on one fixed prompt set."""

import io
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from lmlab.api import IGNORE_INDEX
from lmlab.errors import UserError

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 4, 16, 128


@dataclass
class Figures:
    val_loss: float
    memory_bytes: int
    disk_bytes: int
    tokens_per_s: float

    @property
    def val_ppl(self) -> float:
        return math.exp(self.val_loss) if self.val_loss < 700 else math.inf

    def as_dict(self) -> dict:  # noqa: D102
        return {"val_loss": self.val_loss, "val_ppl": self.val_ppl, "disk_bytes": self.disk_bytes,
                "memory_bytes": self.memory_bytes, "tokens_per_s": self.tokens_per_s}


@torch.no_grad()
def validation_loss(model, objective, tokens, block_size: int, batch_size: int, seed: int) -> float:
    """The objective's token-weighted mean loss over every window of the validation split, as the
    run's final evaluation computes it (``lmlab.train.module``)."""
    from lmlab.train.batches import FixedWindowBatches, FixedWindows

    if objective.sampling != "windows":
        raise UserError(f"objective {objective.name!r} samples padded documents; compress measures runs "
                        "evaluated on windows", key="objective.use")
    device = next(model.parameters()).device
    if objective.wants_windows():
        labels = objective.token_labels(tokens.split("val"))
        batches = FixedWindowBatches(tokens.val, block_size, batch_size, seed, labels=labels)
        items = (objective.make_batch_from(batches[i]) for i in range(len(batches)))
    else:
        windows = FixedWindows(tokens.val, block_size)
        items = (objective.make_batch(torch.stack([windows[j] for j in range(i, min(i + batch_size, len(windows)))]))
                 for i in range(0, len(windows), batch_size))
    total, count = 0.0, 0
    for batch in items:
        batch = batch.to(device) if hasattr(batch, "to") else batch
        loss = objective.loss(model(batch.input_ids), batch)
        n = int((batch.targets != IGNORE_INDEX).sum())
        total += float(loss) * n
        count += n
    return total / max(count, 1)


def memory_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (a tied head is free)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def weights(model: torch.nn.Module) -> int:
    """The model's parameters, counting each weight a quantised layer stands for: a module that
    declares ``in_features`` and ``out_features`` and holds its weight other than as a parameter
    (as codes in buffers) counts in × out, so that ``params`` means the same before and after."""
    quantised = sum(m.in_features * m.out_features for m in model.modules()
                    if hasattr(m, "in_features") and hasattr(m, "out_features")
                    and not isinstance(getattr(m, "weight", None), torch.nn.Parameter))
    return model.num_params() + quantised


def state_bytes(state: dict) -> int:
    """The size of ``state`` as torch.save writes it: what a weights file of the model takes on disk."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def prompt_set(tokens: np.ndarray, count: int = PROMPTS, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, evenly spread over the validation split: the same for
    every method compressing the run, so their speeds compare."""
    starts = np.linspace(0, len(tokens) - length - 1, count).astype(np.int64)
    return [np.asarray(tokens[s:s + length], dtype=np.int64).tolist() for s in starts]


def generation_speed(models: list, decoder, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
                     rounds: int = 3) -> list[float]:
    """Tokens per second of each model generating ``new_tokens`` after each prompt, one prompt at a time
    (batch 1, the latency case): rounds interleave the models so a busy moment of the machine falls on
    all of them alike, and each model's figure is its median round (after one warm-up prompt)."""
    import statistics

    from lmlab.generation.token_ids import generate_tensor

    def one(model, prompt, n):
        device = next(model.parameters()).device
        generate_tensor(decoder, model, torch.tensor([prompt], device=device), n,
                        generator=torch.Generator(device=device).manual_seed(0))

    for model in models:
        one(model, prompts[0], 8)
    speeds = [[] for _ in models]
    for _ in range(rounds):
        for model, out in zip(models, speeds):
            started = time.perf_counter()
            for prompt in prompts:
                one(model, prompt, new_tokens)
            out.append(len(prompts) * new_tokens / (time.perf_counter() - started))
    return [statistics.median(s) for s in speeds]
