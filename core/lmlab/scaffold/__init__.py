"""``lmlab new-plugin``: writes a complete third-party plugin distribution from the templates here.

The templates are files under ``templates/`` (package data, shipped in the wheel), filled in with
:class:`string.Template` (``$name``; Python and TOML never use ``$``, so no escaping is needed). Each
ends in ``.tmpl``, so that no tool takes a template for Python source of the core:

    templates/common/         pyproject.toml, README.md, the package's __init__.py, example.toml, ...
    templates/slots/<slot>/   plugin.py, test.py and table.toml (the slot's manifest table) of a slot,
                              and README.md where the common one does not fit (compress)
    templates/slots/generic/  the same for a slot without its own: a plugin that implements a hook

Every slot of ``lmlab.api.SLOT_BASES`` has a template: attention, position and ffn (the slots of the
conformance kit), peft, compress, filter and every other slot with a base class of its own have
dedicated ones, whose tests run the slot's kit; the rest (monitor, whose plugins act through lifecycle
hooks) use the generic one. A
compress method runs on a trained run (``lmlab compress``), not in a training manifest: its table is
a comment saying so, and its example trains the run to compress. An executor is named on the command
line (``lmlab run --executor``): its example is a sweep of two seeds to run through it.
A generated plugin imports from the core only ``lmlab.api``; its tests also use ``lmlab.testing``.
"""

import keyword
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from string import Template

from lmlab import __version__, discovery
from lmlab.errors import UserError, did_you_mean

TEMPLATES = Path(__file__).resolve().parent / "templates"
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

#: What a plugin class of each slot is called after its name: ``demo`` → ``DemoAttention``.
CLASS_SUFFIX = {"data": "Data", "ffn": "FeedForward", "decoding": "Decoder", "peft": "Peft"}


@dataclass(frozen=True)
class Plan:
    """Everything a plugin's files are rendered from."""

    name: str  # the entry-point name, what manifests write in `use`
    slot: str
    dist: str  # lmlab-<name>
    package: str  # lmlab_<name with _>
    module: str  # the module holding the plugin class
    cls: str  # the plugin class
    base: str  # its base class in lmlab.api

    def values(self) -> dict[str, str]:
        many = self.slot in discovery.MANY_SLOTS
        return {
            "name": self.name, "slot": self.slot, "dist": self.dist, "package": self.package,
            "module": self.module, "cls": self.cls, "base": self.base,
            "lmlab_requirement": f"lmlab>={__version__}",
            "use_value": f'["{self.name}"]' if many else f'"{self.name}"',
            # a many-valued slot's options go in a subtable per plugin: [monitor.<name>]
            "options_header": f"\n\n[{self.slot}.{self.name}]" if many else "",
            "generic_imports": ", ".join(sorted({self.base or "Plugin", "Field", "Options", "hookimpl"})),
        }


def slot_template_dir(slot: str) -> Path:
    own = TEMPLATES / "slots" / slot
    return own if own.is_dir() else TEMPLATES / "slots" / "generic"


def plan(name: str, slot: str) -> Plan:
    """Check ``name`` and ``slot`` (a UserError naming what is wrong) and name everything."""
    if not NAME_PATTERN.match(name):
        raise UserError(f"{name!r} is not a valid plugin name: use lowercase letters, digits and single "
                        "dashes, starting with a letter (e.g. 'sliding-window')")
    if slot not in discovery.ALL_SLOTS:
        raise UserError(f"unknown slot {slot!r}{did_you_mean(slot, discovery.ALL_SLOTS)}; "
                        f"slots: {', '.join(discovery.ALL_SLOTS)}", key="--slot")
    snake = name.replace("-", "_")
    module = snake + "_" if keyword.iskeyword(snake) else snake  # `from lmlab_x.class_ import ...`
    camel = "".join(part.capitalize() for part in name.split("-"))
    suffix = CLASS_SUFFIX.get(slot, slot.capitalize())
    cls = camel if camel.endswith(suffix) else camel + suffix
    return Plan(name=name, slot=slot, dist=f"lmlab-{name}", package=f"lmlab_{snake}", module=module, cls=cls,
                base=_base_class_name(slot))


def _base_class_name(slot: str) -> str:
    """The slot's base class in lmlab.api, for the generic template (the dedicated ones name theirs)."""
    if (TEMPLATES / "slots" / slot).is_dir():
        return ""
    from lmlab.api import SLOT_BASES  # imports torch: only for slots without their own template

    return SLOT_BASES[slot].__name__


def render(p: Plan) -> dict[str, str]:
    """Relative path → text of every file of the distribution."""
    values = p.values()
    slot_dir = slot_template_dir(p.slot)
    common = TEMPLATES / "common"

    def fill(directory: Path, name: str, **extra: str) -> str:
        path = directory / f"{name}.tmpl"
        try:
            return Template(path.read_text(encoding="utf-8")).substitute(values, **extra)
        except (KeyError, ValueError) as exc:  # a template bug, not the user's input
            raise RuntimeError(f"template {path.relative_to(TEMPLATES)}: bad placeholder {exc}") from exc

    table = fill(slot_dir, "table.toml").strip()
    # A slot whose example needs other data (an order ranks many documents) brings its own table.
    data_dir = slot_dir if (slot_dir / "data_table.toml.tmpl").is_file() else common
    data_table = "" if p.slot == "data" else fill(data_dir, "data_table.toml").strip() + "\n\n"
    tracker_table = "" if p.slot == "tracker" else '[tracker]\nuse = "none"\n\n'
    return {
        "pyproject.toml": fill(common, "pyproject.toml"),
        "README.md": fill(slot_dir if (slot_dir / "README.md.tmpl").is_file() else common, "README.md", table=table),
        ".gitignore": fill(common, "gitignore"),
        "example.toml": fill(common, "example.toml", data_table=data_table, tracker_table=tracker_table,
                             table=table),
        "example.txt": (common / "example.txt.tmpl").read_text(encoding="utf-8"),  # taken as it is
        f"src/{p.package}/__init__.py": fill(common, "package_init.py"),
        f"src/{p.package}/{p.module}.py": fill(slot_dir, "plugin.py"),
        f"tests/test_{p.package}.py": fill(slot_dir, "test.py"),
    }


def create(name: str, slot: str, directory: str | os.PathLike = ".") -> tuple[Path, Plan]:
    """Write the distribution of plugin ``name`` for ``slot`` into ``directory/lmlab-<name>``.

    Refuses (UserError) a bad name, an unknown slot, or a target that exists. The files are written
    into a temporary folder beside the target and moved into place at the end, so a failure leaves
    nothing behind.
    """
    p = plan(name, slot)
    parent = Path(directory).expanduser()
    target = parent / p.dist
    if target.exists() or target.is_symlink():
        raise UserError("already exists; remove it or choose another --dir", key=str(target))
    if parent.exists() and not parent.is_dir():
        raise UserError("is not a folder", key=str(parent))
    files = render(p)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{p.dist}-", dir=parent))
    except OSError as exc:
        raise UserError(f"cannot create the plugin here: {exc.strerror or exc}", key=str(parent)) from None
    try:
        for relative, text in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        staging.chmod(0o777 & ~_umask())
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target, p


def name_clashes(p: Plan) -> list[str]:
    """Distributions that already provide a ``p.slot`` plugin named ``p.name`` (installed or catalogued)."""
    found = {info.distribution for info in discovery.installed().get(p.slot, []) if info.name == p.name}
    found |= {e["distribution"] for e in discovery.catalogue()
              if e.get("slot") == p.slot and e.get("name") == p.name and "distribution" in e}
    return sorted(found)


def _umask() -> int:
    if sys.platform == "win32":
        return 0
    mask = os.umask(0)
    os.umask(mask)
    return mask
