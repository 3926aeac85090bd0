"""A PEFT run's adapter as Hugging Face's peft library saves it: ``adapter_config.json`` and
``adapter_model.safetensors``, for ``PeftModel.from_pretrained`` on the base checkpoint in
transformers.

The peft plugin gives its adapter named by lmlab's modules (``Peft.adapter_export``); the modules are
renamed to the exported checkpoint's by asking the architecture's ``hf_export`` where each base weight
goes: a weight it passes through as it stands keeps its module's adapter valid under the new name. A
weight the export transforms (GPT-2's transposed Conv1D, a fused projection) would need its adapter
transformed too, and is refused naming the module.
"""

import json
import re
from pathlib import Path

import torch

from lmlab.errors import UserError
from lmlab.train.adapters import BASE_FILE, read_file

#: peft config options other than target_modules that name modules of the model.
MODULE_OPTIONS = ("feedforward_modules", "exclude_modules")
#: Where a peft model's own modules start in the names of a saved adapter (PeftModel.base_model.model).
PEFT_PREFIX = "base_model.model."


def renamed_modules(export, base: dict[str, torch.Tensor]) -> dict[str, str]:
    """lmlab module → Hugging Face module, for every base weight ``export`` (the architecture's
    ``hf_export`` applied to a state dict) passes through untouched, found by which tensor object
    lands under which name."""
    out_state = export(dict(base))
    where = {id(tensor): name for name, tensor in out_state.items()}
    modules = {}
    for name, tensor in base.items():
        theirs = where.get(id(tensor))
        if theirs is not None and name.endswith(".weight") and theirs.endswith(".weight"):
            modules[name[:-len(".weight")]] = theirs[:-len(".weight")]
    return modules


def base_state(run) -> dict[str, torch.Tensor]:
    """The weights the run's adapter was trained on (checkpoints/base.safetensors)."""
    path = Path(run.checkpoint).parent / BASE_FILE
    if not path.is_file():
        raise UserError(f"has no {BASE_FILE} beside its checkpoint: not a PEFT run lmlab wrote", key=str(path.parent))
    return read_file(path)[0]


def adapter_files(run, export, base_model: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and the adapter's weights under the Hugging Face checkpoint's names."""
    plugin = run.peft
    try:
        config, state = plugin.adapter_export(run.model)
    except NotImplementedError:
        raise UserError(f"peft plugin {plugin.name!r} makes an adapter Hugging Face's peft library cannot load; "
                        "fold it into the base weights (lmlab merge) and export the merged run as hf",
                        key="peft.use") from None
    modules = renamed_modules(export, base_state(run))
    renamed, targets = {}, set()
    for key, tensor in state.items():
        module = next((m for m in _prefixes(key) if m in modules), None)
        if module is None:
            raise UserError(f"the adapter on {key.rsplit('.', 2)[0]} sits on a weight the Hugging Face checkpoint "
                            "stores in another form, so it cannot be written as a peft adapter; fold it in "
                            "(lmlab merge) and export the merged run as hf", key="peft.targets")
        targets.add(modules[module])
        renamed[PEFT_PREFIX + modules[module] + key[len(module):]] = tensor.detach().contiguous()
    for key in MODULE_OPTIONS:  # e.g. IA3's feedforward_modules: the ones among the targets it scales inputs of
        if config.get(key):
            config[key] = _renamed_option(config[key], modules)
    config.update(target_modules=sorted(targets), base_model_name_or_path=base_model, task_type="CAUSAL_LM",
                  inference_mode=True)
    return config, renamed


def _renamed_option(value, modules: dict[str, str]) -> list[str]:
    """A peft option naming modules (a regular expression over full names, or a list of names) as the
    list of the Hugging Face names of the modules it names."""
    if isinstance(value, str):
        return sorted(theirs for ours, theirs in modules.items() if re.fullmatch(value, ours))
    return sorted(theirs for ours, theirs in modules.items() if any(ours == v or ours.endswith("." + v) for v in value))


def _prefixes(key: str):
    """The module names an adapter entry may hang from, longest first."""
    parts = key.split(".")
    return (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))


def write(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
