"""Other runs a decoder loads (``Decoder.needs_runs``): a speculative decoder's draft model.

The draft must read and write the same token ids as the target, so its tokenizer is compared with
the target's id by id before anything is decoded.
"""

from pathlib import Path

from lmlab.errors import UserError


def prepare_decoder(decoder, run) -> None:
    """Load the runs ``decoder`` names, check their tokenizers against ``run``'s (an Assembly: model,
    tokenizer), hand them over."""
    from lmlab.trained import load_run

    runs = {}
    for name in decoder.needs_runs:
        path = getattr(decoder.options, name, None)
        key = f"decoding.{name}"
        if not path:
            raise UserError(f"{decoder.name!r} needs a run folder here", key=key)
        if not (Path(path) / "manifest.toml").is_file():
            raise UserError(f"{path} is not a run folder (no manifest.toml)", key=key)
        other = load_run(Path(path))
        if why := tokenizer_mismatch(run.tokenizer, other.tokenizer):
            raise UserError(f"the run in {path} has a different tokenizer from the target's ({why}); a draft must "
                            "share the target's token ids", key=key)
        model = other.model.to(next(run.model.parameters()).device).eval()
        runs[name] = model
    decoder.prepare(run.model, runs)


def tokenizer_mismatch(a, b) -> str | None:
    """Why two tokenizers give different ids (None when every id decodes the same in both)."""
    if a.vocab_size != b.vocab_size:
        return f"{a.vocab_size} vs {b.vocab_size} ids"
    if a.eos_id != b.eos_id:
        return f"end-of-text id {a.eos_id} vs {b.eos_id}"
    for i in range(a.vocab_size):
        if a.decode([i]) != b.decode([i]):
            return f"id {i} is {a.decode([i])!r} vs {b.decode([i])!r}"
    return None
