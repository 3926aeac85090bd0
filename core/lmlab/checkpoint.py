"""Loading trained weights from a run folder (never unpickling arbitrary objects)."""

from pathlib import Path

import torch

from lmlab.errors import UserError


def best_or_last(run_dir: Path) -> Path:
    for name in ("best.ckpt", "last.ckpt"):
        path = run_dir / "checkpoints" / name
        if path.is_file():
            return path
    raise UserError("holds no checkpoints/best.ckpt or last.ckpt", key=str(run_dir))


def model_state(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The LanguageModel state dict of a Lightning checkpoint, and its global step."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if "lmlab_peft" in checkpoint:  # adapter entries only (lmlab.train.adapters)
        raise UserError(f"holds only a {checkpoint['lmlab_peft']['plugin']} adapter, not a whole model; fold it "
                        f"into the base weights first: lmlab merge {path.parent.parent}", key=str(path))
    return state_of(checkpoint), int(checkpoint.get("global_step", 0))


def state_of(checkpoint: dict) -> dict[str, torch.Tensor]:
    """The LanguageModel entries of a loaded Lightning checkpoint's state dict."""
    prefix = "model."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}  # saved from a compiled model


def load_model_weights(model: torch.nn.Module, path: Path) -> int:
    """Load the LanguageModel weights of a Lightning checkpoint; returns its global step."""
    state, step = model_state(path)
    model.load_state_dict(state)
    return step
