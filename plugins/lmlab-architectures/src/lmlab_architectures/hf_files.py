"""The file layout of a Hugging Face checkpoint folder, as ``save_pretrained`` writes it: config.json
and the weights in safetensors (pickled ``.bin`` weights are never read: unpickling can run code)."""

import json
from pathlib import Path

import torch

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


class ReadsHF:
    """``Architecture``'s Hugging Face readers, delegated by the folder's model_type to ``hf_readers``:
    modules with ``folder_tables``, ``weight_files`` and ``read_state`` for their families' folders."""

    hf_readers: dict = {}  # model_type → reader module

    @classmethod
    def hf_reader(cls, folder: Path):
        kind = model_type(folder)
        if kind not in cls.hf_readers:
            raise ValueError(f"config.json has model_type {kind!r}; architecture {cls.name!r} reads "
                             f"{', '.join(sorted(cls.hf_readers))}")
        return cls.hf_readers[kind]

    @classmethod
    def hf_tables(cls, folder: Path) -> dict:
        return cls.hf_reader(folder).folder_tables(folder)

    @classmethod
    def hf_weight_files(cls, folder: Path) -> list[Path]:
        return cls.hf_reader(folder).weight_files(folder)

    @classmethod
    def hf_state(cls, folder: Path) -> dict:
        return cls.hf_reader(folder).read_state(folder)

    @classmethod
    def hf_export(cls, tables: dict, state: dict) -> tuple[dict, dict]:
        """Written by the first reader whose family holds the model (``writable`` says why not)."""
        why = []
        for reader in dict.fromkeys(cls.hf_readers.values()):
            problem = reader.writable(tables)
            if problem is None:
                return reader.to_hf(tables, state)
            why.append(problem)
        raise ValueError("; ".join(why) or f"architecture {cls.name!r} writes no Hugging Face checkpoints")


def model_type(folder: Path) -> str | None:
    """config.json's model_type."""
    return json.loads((Path(folder) / "config.json").read_text()).get("model_type")


def read_config(folder: Path, model_type: str, family: str, defaults: dict) -> dict:
    """config.json's values over ``defaults`` (the transformers config class's, for keys an older or
    hand-written file leaves out); a ValueError when its model_type is not ``model_type``."""
    config = json.loads((Path(folder) / "config.json").read_text())
    kind = config.get("model_type")
    if kind != model_type:
        raise ValueError(f"config.json has model_type {kind!r}; this reader takes {family} checkpoints "
                         f"(model_type {model_type!r})")
    return {**defaults, **config}


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: one, or the shards its index names, in order."""
    folder = Path(folder)
    if (folder / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((folder / SAFETENSORS_INDEX).read_text())["weight_map"]
        return [folder / name for name in dict.fromkeys(sorted(weight_map.values()))]
    return [folder / SAFETENSORS]


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, in the checkpoint's own names, on the CPU."""
    from safetensors.torch import load_file  # an ImportError here says which package is missing

    state = {}
    for path in weight_files(folder):
        state.update(load_file(path, device="cpu"))
    return state
