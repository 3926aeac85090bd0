"""The sample text ``lmlab run`` prints at the end of a causal run: one prompt through the run's decoder."""

import torch


@torch.no_grad()
def generate_text(model, tokenizer, decoder, prompt: str, max_new_tokens: int, seed: int = 0) -> str:
    from lmlab.generation.batch import generate_texts

    return generate_texts(model, tokenizer, decoder, [prompt], max_new_tokens, seed=seed).outputs.completions[0].text
