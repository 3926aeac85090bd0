"""Text from a model: prompt → tokens → the decoding plugin → text."""

import torch


@torch.no_grad()
def generate_text(model, tokenizer, decoder, prompt: str, max_new_tokens: int, seed: int = 0) -> str:
    ids = list(tokenizer.encode(prompt)) or [tokenizer.eos_id or 0]
    device = next(model.parameters()).device
    prompt_ids = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        out = decoder.generate(model, prompt_ids, max_new_tokens, eos_id=tokenizer.eos_id, generator=generator)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, len(ids):].tolist())
