"""Which installed architecture plugin reads a Hugging Face checkpoint folder (``[init] from``).

A Hugging Face folder says its family in config.json's ``model_type``; the architecture plugins that
build a family's models say which model types they read (``Architecture.hf_model_types``) and convert
the folder (``hf_tables``, ``hf_weight_files``, ``hf_state``). The core asks them, so it names no
family; they are imported only when a folder is read.
"""

import json
from pathlib import Path

from lmlab.errors import UserError

#: The kind of an init that is a Hugging Face folder (its record's ``format``): the family's name as
#: its architecture plugin gives it ("Hugging Face Llama").
HUGGING_FACE = "Hugging Face {family}"


def reader_for(folder: Path, refuse) -> tuple[str, type, str]:
    """The architecture plugin that reads a Hugging Face folder, by its config.json's model_type: its
    name, its class and the family's name (a UserError for a model_type no installed one reads)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise refuse(f"its config.json is not readable JSON ({exc})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    found, broken = readers()
    if isinstance(model_type, str) and model_type in found:
        return found[model_type]
    known = " and ".join(f"{family} (\"{t}\", the {name!r} architecture)" for t, (name, _, family) in found.items())
    failed = f"; architectures that failed to load: {', '.join(broken)} (see `lmlab plugins architecture`)" \
        if broken else ""
    raise refuse(f"config.json has model_type {model_type!r}; the installed architectures read "
                 f"{'Hugging Face ' + known if known else 'no Hugging Face'} checkpoints{failed}")


def readers() -> tuple[dict[str, tuple[str, type, str]], list[str]]:
    """config.json model_type → (architecture name, class, family name) over the installed architecture
    plugins (imported here, when a Hugging Face folder is read), and the names of those that failed to
    load: a broken plugin that reads another family does not stop this one."""
    from lmlab import discovery

    readers, broken = {}, []
    for name in dict.fromkeys(info.name for info in discovery.installed().get("architecture", [])):
        try:
            cls = discovery.load("architecture", name)
        except UserError:
            broken.append(name)
            continue
        for model_type, family in cls.hf_model_types.items():
            readers.setdefault(model_type, (name, cls, family))  # the first by name, as installed() sorts
    return readers, broken


def load_reader(name: str) -> type:
    """The architecture plugin ``name`` (what :func:`reader_for` found), to read a folder with."""
    from lmlab import discovery

    return discovery.load("architecture", name, key="init.from")
