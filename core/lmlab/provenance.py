"""Where a run came from: the plugin distributions it used, the code revision and the environment.

Written to ``provenance.json`` when a run starts (so an interrupted or failed run has it too) and
repeated in ``summary.json``; ``lmlab rerun`` reads it back and names what differs from the present
environment. Nothing here imports torch unless asked for the device.
"""

import importlib.metadata as md
import platform
import subprocess
from pathlib import Path

from lmlab import __version__

#: Where the lmlab sources live: a git checkout there gives the revision.
SOURCE_DIR = Path(__file__).resolve().parent


def plugins(variant) -> dict:
    """slot → {name, distribution, version} of each plugin the variant uses (many-valued slots: a list;
    a stand-in that no entry point provides, ``Variant.with_plugin``'s, records its class instead);
    a plugin composed of others (``Architecture.components``) lists them under ``components``, by the
    dotted key of their table below the slot (``mixers.M``)."""
    from lmlab import discovery

    def entry(slot: str, choice) -> dict:
        info = discovery.installed_as(slot, choice.plugin)
        if info is None:  # a stand-in no manifest can name (Variant.with_plugin): where its code is
            out = {"name": choice.name, "distribution": None, "version": None,
                   "class": f"{choice.plugin.__module__}:{choice.plugin.__qualname__}"}
        else:
            out = {"name": choice.name, "distribution": info.distribution, "version": info.version}
        declared = getattr(choice.plugin, "components", None) or {}
        nested = {f"{field}.{label}": entry(declared[field], inner)
                  for field, chosen in choice.components.items() for label, inner in chosen.items()}
        if nested:
            out["components"] = nested
        return out

    out = {}
    for slot, chosen in variant.slots.items():
        entries = [entry(slot, c) for c in (chosen if isinstance(chosen, tuple) else (chosen,))]
        out[slot] = entries if slot in discovery.MANY_SLOTS else entries[0]
    return out


def environment(device: bool = True) -> dict:
    """Versions of lmlab, Python, torch and Lightning, the git revision of lmlab's checkout (when it
    is one), how training sets up malloc (lmlab.train.allocator) and the device a run would use."""
    from lmlab.train import allocator

    env = {"lmlab": __version__, "git": git_revision(SOURCE_DIR), "python": platform.python_version(),
           "torch": _version("torch"), "lightning": _version("lightning"), "platform": platform.platform(),
           "malloc": allocator.setting()}
    if device:
        env["device"] = device_name()
    return env


def git_revision(directory: Path) -> str | None:
    """The commit checked out at ``directory``, with ``-dirty`` when tracked files are modified; None
    outside a git checkout (an installed wheel) or without git."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()

        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def differences(recorded: dict, current: dict) -> list[str]:
    """Human-readable lines for each recorded value that the current environment does not match."""
    lines = []
    for key in sorted(set(recorded) | set(current)):
        if key in ("platform",):
            continue  # kernel point releases differ between any two machines; too noisy to warn about
        was, now = recorded.get(key), current.get(key)
        if was != now:
            lines.append(f"{key}: {was} when recorded, {now} now")
    return lines


def plugin_differences(recorded: dict, current: dict) -> list[str]:
    """Lines for each slot whose plugin distribution or version differs."""
    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for slot, entry in tree.items():
            for e in entry if isinstance(entry, list) else [entry]:
                out[f"{prefix}{slot}.{e['name']}"] = f"{e['distribution']} {e['version']}"
                out.update(flat(e.get("components", {}), f"{prefix}{slot}."))
        return out

    was, now = flat(recorded), flat(current)
    return [f"{key}: {was.get(key, 'absent')} when recorded, {now.get(key, 'absent')} now"
            for key in sorted(set(was) | set(now)) if was.get(key) != now.get(key)]


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
