"""The manifest's text and tables: reading a TOML file, and turning one table into its Options class
with every error naming the key. Below everything that reads manifests (resolution, validation,
[init], the sweep planner), so that none of them imports another to do it."""

import re
import tomllib
from pathlib import Path
from typing import Any

from lmlab.errors import did_you_mean
from lmlab.errors import UserError

TOP_LEVEL = ("name", "seed", "description", "sweep")
CORE_TABLE_NAMES = ("model", "train", "init", "resolved", "eval")  # lmlab.config.CORE_TABLES, named without importing pydantic
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UserError("no such manifest file", key=str(path)) from None
    except IsADirectoryError:
        raise UserError("is a folder, not a manifest file", key=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"malformed TOML: {exc}", key=str(path)) from None
    except UnicodeDecodeError as exc:
        raise UserError(f"is not a TOML manifest: not UTF-8 text (byte {exc.start})", key=str(path)) from None
    except OSError as exc:
        raise UserError(f"cannot be read: {exc.strerror}", key=str(path)) from None


def validate_options(options_cls, values: Any, prefix: str, base_dir: Path, plugin: str | None = None):
    """``values`` (a manifest table) as an instance of ``options_cls``; a UserError naming the key
    (``prefix``.option) of the first problem. Relative paths resolve against ``base_dir``."""
    from pydantic import ValidationError

    if not isinstance(values, dict):
        raise UserError("must be a table", key=prefix)
    try:
        return options_cls.model_validate(values, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise _user_error(exc, options_cls, prefix, plugin) from None


def _user_error(exc, options_cls, prefix: str, plugin: str | None) -> UserError:
    from lmlab.api.options import TYPE_ERROR

    errors = exc.errors()
    first = errors[0]
    # Past the option's name, a string in the location names a union member (`constrained-int`), not a key.
    loc = ".".join(str(p) for i, p in enumerate(first["loc"]) if i == 0 or not isinstance(p, str))
    key = f"{prefix}.{loc}" if loc else prefix
    owner = f" of plugin {plugin!r}" if plugin else f" in [{prefix}]"
    if first["type"] == "extra_forbidden":
        names = [field.alias or name for name, field in options_cls.model_fields.items()]  # [init] `from`
        message = f"unknown option{owner}{did_you_mean(loc, names)}"
    else:
        message = first["msg"]
        if first["type"] not in ("missing", TYPE_ERROR):  # a type error says what it got, as TOML wrote it
            message += f" (got {first['input']!r})"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return UserError(message + more, key=key)
