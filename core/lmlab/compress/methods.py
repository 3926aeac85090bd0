"""The methods named on the command line: ``--use a --use b`` (or ``--use a,b``) in the order they run,
each with its options from ``--set NAME.KEY=VALUE`` (``--set KEY=VALUE`` when only one is named),
validated by the plugin's own Options as a manifest's ``[compress.NAME]`` table would be."""

from dataclasses import dataclass
from pathlib import Path

from lmlab.errors import UserError


@dataclass
class Method:
    name: str
    plugin: object  # the Compressor instance
    table: dict  # the options as given (the manifest's [compress.NAME] table)

    @property
    def options(self) -> dict:
        return self.plugin.options.model_dump(mode="json")

    @property
    def label(self) -> str:
        """The method and the options set for it, for the new run folder's name: ``rtn(bits=3)``."""
        if not self.table:
            return self.name
        return f"{self.name}({','.join(f'{k}={v}' for k, v in sorted(self.table.items()))})"


def resolve(uses: list[str], sets: list[str], base_dir: Path) -> list[Method]:
    from lmlab import discovery
    from lmlab.manifest import parse_value
    from lmlab.tables import validate_options

    names = [n.strip() for item in uses for n in item.split(",") if n.strip()]
    if not names:
        raise UserError("name at least one compress method (lmlab plugins compress lists them)", key="--use")
    if len(set(names)) < len(names):
        raise UserError(f"names a method twice ({', '.join(names)})", key="--use")
    tables: dict[str, dict] = {n: {} for n in names}
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"takes NAME.KEY=VALUE, got {item!r}", key="--set")
        key = key.strip().removeprefix("compress.")
        name, dot, option = key.rpartition(".")
        if not dot:
            if len(names) > 1:
                raise UserError(f"{key!r}: with several methods, say whose option it is (NAME.{key}=...)", key="--set")
            name, option = names[0], key
        if name not in tables:
            raise UserError(f"{name!r} is not one of the methods named by --use ({', '.join(names)})",
                            key=f"compress.{name}.{option}")
        tables[name][option] = parse_value(text.strip())
    methods = []
    for name in names:
        cls = discovery.load("compress", name, key="--use")
        options = validate_options(cls.Options, tables[name], f"compress.{name}", base_dir, plugin=name)
        methods.append(Method(name, cls(options), tables[name]))
    return methods
