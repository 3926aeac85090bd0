"""PEFT in a run: the ``[peft]`` plugin applied once when the run is built, the frozen base weights
written once, checkpoints that hold only the adapter, and a PEFT run's model rebuilt for ``lmlab
generate`` and ``lmlab merge``.

A run whose peft plugin adds an adapter (``Peft.is_adapter_key`` matches some entry) keeps, in
``checkpoints/``:

  base.safetensors     the model's weights just before the adapter went in (fresh or from [init]),
                       written once when the run starts; its SHA-256 is recorded in every checkpoint
  last.ckpt, best.ckpt Lightning checkpoints whose ``state_dict`` holds only the adapter's entries,
                       with the optimizer state, the random state and ``lmlab_peft`` = {plugin, base,
                       base_sha256, state (the plugin's extra_state)}
  adapter.safetensors  the adapter alone at the last checkpoint (metadata: plugin, options, step,
                       base_sha256), for tools that do not read Lightning checkpoints

Resuming rebuilds the model, loads ``base.safetensors`` (checked against the checkpoint's hash),
applies the plugin again and lets Lightning load the adapter, optimizer and random state: the run
continues exactly as an uninterrupted one. Without an adapter (no ``[peft]`` table, ``none``, a plugin
that only implements hooks) nothing here runs and checkpoints hold the whole model, as before.
"""

import hashlib
import json
from pathlib import Path

import torch

from lmlab.api import UserError
from lmlab.api.peft import Peft
from lmlab.rundir import atomic_write_bytes

BASE_FILE = "base.safetensors"
ADAPTER_FILE = "adapter.safetensors"
PREFIX = "model."  # the LanguageModel's entries in the LightningModule's state dict


class PeftRun:
    """A run's peft plugin together with the model it adapted and the base it started from."""

    def __init__(self, plugin: Peft, model: torch.nn.Module, base_bytes: bytes | None, base_sha256: str):
        self.plugin, self.model = plugin, model
        self.base_sha256 = base_sha256
        self._base_bytes = base_bytes  # None once written (or when it was read from the run folder)
        self.adapter_bytes: int | None = None  # size of the last adapter.safetensors written
        # Dispatched once: most methods add nothing to the loss.
        overrides = type(plugin).regularization is not Peft.regularization
        self.regularization = plugin.regularization if overrides else None

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if self.plugin.is_adapter_key(k)}

    def write_base(self, ckpt_dir: Path, main: bool) -> None:
        """Once per run, before the first checkpoint: the main process writes, every process lets go."""
        if self._base_bytes is not None and main:
            atomic_write_bytes(ckpt_dir / BASE_FILE, self._base_bytes)
        self._base_bytes = None

    def write_adapter(self, ckpt_dir: Path, step: int) -> None:
        options = self.plugin.options.model_dump(mode="json")
        data = _serialise(self.adapter_state(), {"peft": self.plugin.name, "options": json.dumps(options),
                                                 "step": str(step), "base_sha256": self.base_sha256})
        atomic_write_bytes(ckpt_dir / ADAPTER_FILE, data)
        self.adapter_bytes = len(data)

    def prune(self, checkpoint: dict) -> None:
        """LightningModule.on_save_checkpoint: keep the adapter's entries, drop the base's."""
        state = checkpoint["state_dict"]
        checkpoint["state_dict"] = {k: v for k, v in state.items()
                                    if not k.startswith(PREFIX) or self.plugin.is_adapter_key(k[len(PREFIX):])}
        checkpoint["lmlab_peft"] = {"plugin": self.plugin.name, "base": BASE_FILE, "base_sha256": self.base_sha256,
                                    "state": self.plugin.extra_state()}

    def restore(self, checkpoint: dict) -> None:
        """LightningModule.on_load_checkpoint, before Lightning loads the state dict without strictness
        (the base entries are the ones this process loaded from base.safetensors; some, such as a 4-bit
        layer's quantisation state, would not even load back): the adapter entries must be exactly the
        model's."""
        info = checkpoint.get("lmlab_peft")
        if info is None:
            raise RuntimeError("this checkpoint holds a whole model, not an adapter: it was not written by a "
                               f"run with peft plugin {self.plugin.name!r}")
        if info["base_sha256"] != self.base_sha256:
            raise UserError(f"the checkpoint's adapter was trained on base weights with SHA-256 "
                            f"{info['base_sha256'][:12]}…, but {BASE_FILE} has {self.base_sha256[:12]}…",
                            key=BASE_FILE)
        saved = {k[len(PREFIX):] for k in checkpoint["state_dict"] if k.startswith(PREFIX)}
        _same_adapter(saved, set(self.adapter_state()), "last.ckpt")
        self.plugin.load_extra_state(info.get("state") or {})


def check_parallel(plugin: Peft, run) -> None:
    """Refuse a parallel strategy the peft plugin does not support, naming peft.use."""
    parallel = run.uses("parallel")
    if plugin.parallel is not None and parallel not in plugin.parallel:
        raise UserError(f"peft plugin {plugin.name!r} works under parallel {', '.join(plugin.parallel)}, not "
                        f"{parallel!r} (its adapter and checkpoints are not made for a sharded or split model)",
                        key="peft.use")


def apply_peft(plugin: Peft | None, model: torch.nn.Module, run, ckpt_dir: Path,
               resuming: bool) -> PeftRun | None:
    """Apply the variant's peft plugin to the freshly built (and initialised) ``model``; None when the
    run has no adapter. ``resuming``: the run continues from ``ckpt_dir/last.ckpt``, so its base
    weights are loaded from ``ckpt_dir/base.safetensors`` before the adapter goes in."""
    if plugin is None:
        return None
    check_parallel(plugin, run)
    if type(plugin).is_adapter_key is Peft.is_adapter_key:  # declares no adapter (none, hooks only)
        plugin.apply(model, run)
        return None
    base_path = ckpt_dir / BASE_FILE
    if resuming and base_path.is_file():
        data = base_path.read_bytes()
        model.load_state_dict(_deserialise(data)[0])
        fresh = None
    else:
        data = fresh = _serialise(model.state_dict(), {"format": "lmlab base weights"})
    sha = hashlib.sha256(data).hexdigest()
    del data
    plugin.apply(model, run)
    keys = {k for k in model.state_dict() if plugin.is_adapter_key(k)}
    if not keys:
        return None
    if resuming and fresh is not None:
        raise UserError("is missing: the run's adapter checkpoints need the base weights they adapt",
                        key=str(base_path))
    stray = [n for n, p in model.named_parameters() if p.requires_grad and n not in keys]
    if stray:
        raise RuntimeError(f"peft plugin {plugin.name!r} left parameters trainable that are not part of its adapter "
                           f"(is_adapter_key): {', '.join(stray[:4])}{' ...' if len(stray) > 4 else ''}")
    return PeftRun(plugin, model, fresh, sha)


def load_run_weights(model: torch.nn.Module, variant, run_dir: Path, ckpt_path: Path) -> tuple[int, Peft | None]:
    """Load a trained run's weights into ``model``, just built from the run's manifest: the whole
    state of an ordinary checkpoint, or for a PEFT run the base weights, the plugin applied again and
    its adapter. Returns the checkpoint's step and the applied peft plugin (None without one)."""
    from lmlab.checkpoint import load, state_of

    checkpoint = load(ckpt_path)
    step = int(checkpoint.get("global_step", 0))
    from lmlab.compress.restore import KEY, restructure

    if KEY in checkpoint:  # a compressed run: its methods' structure first (lmlab.compress)
        restructure(model, checkpoint[KEY], ckpt_path)
    info = checkpoint.get("lmlab_peft")
    if info is None:
        model.load_state_dict(objective_heads_as_built(model, state_of(checkpoint), start_own=True))
        return step, None
    if "peft" not in variant.plugins:
        raise UserError(f"holds an adapter checkpoint ({info['plugin']}) but its manifest has no [peft] table",
                        key=str(run_dir))
    plugin = variant.instantiate("peft")
    base_path = ckpt_path.parent / info["base"]
    try:
        data = base_path.read_bytes()
    except FileNotFoundError:
        raise UserError("is missing: an adapter checkpoint needs the base weights it adapts",
                        key=str(base_path)) from None
    if hashlib.sha256(data).hexdigest() != info["base_sha256"]:
        raise UserError(f"does not hold the base weights {ckpt_path.name} was trained on (SHA-256 differs)",
                        key=str(base_path))
    model.load_state_dict(_deserialise(data)[0])
    del data
    plugin.apply(model, variant)
    adapter = state_of(checkpoint)
    _same_adapter(set(adapter), {k for k in model.state_dict() if plugin.is_adapter_key(k)}, str(ckpt_path))
    model.load_state_dict(adapter, strict=False)
    plugin.load_extra_state(info.get("state") or {})
    return step, plugin


def objective_heads_as_built(model: torch.nn.Module, state: dict, start_own: bool = False) -> dict:
    """``state`` for a run loaded with another objective than it trained with (``--set objective.use=...``):
    heads of the old objective are left out, and those of the new one, which the checkpoint cannot
    hold, keep the values it built (``start_own``: built without random values, lmlab.unfilled, so
    they are started now, each module by its ``reset_parameters``). A checkpoint holding any of the
    model's heads must hold them all."""
    own = model.state_dict()
    state = {k: v for k, v in state.items() if not k.startswith("heads.") or k in own}
    if not any(k.startswith("heads.") for k in state):
        if start_own and getattr(model, "heads", None) is not None:
            for module in model.heads.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
            own = model.state_dict()
        state.update({k: v for k, v in own.items() if k.startswith("heads.")})
    return state


def _same_adapter(saved: set[str], expected: set[str], where: str) -> None:
    if saved != expected:
        missing, extra = sorted(expected - saved), sorted(saved - expected)
        raise UserError(f"its adapter does not fit the model the manifest builds (missing {missing[:3]}, "
                        f"unexpected {extra[:3]})", key=where)


def _serialise(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes of ``tensors``; entries that are the same tensor (a tied head and embedding)
    are stored once, the others named in the metadata's ``aliases``."""
    from safetensors.torch import save

    unique, aliases, seen = {}, {}, {}
    for name, tensor in tensors.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()), tensor.dtype)
        if identity in seen:
            aliases[name] = seen[identity]
        else:
            seen[identity] = name
            unique[name] = tensor.detach().cpu().contiguous()
    return save(unique, metadata={**metadata, "aliases": json.dumps(aliases, sort_keys=True)})


def _deserialise(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load

    tensors = load(data)
    header_len = int.from_bytes(data[:8], "little")  # the format: u64 header size, JSON header, data
    metadata = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    for alias, name in json.loads(metadata.get("aliases", "{}")).items():
        tensors[alias] = tensors[name]
    return tensors, metadata


def read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a base or adapter file (aliases restored)."""
    return _deserialise(Path(path).read_bytes())
