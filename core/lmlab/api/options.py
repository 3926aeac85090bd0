"""Typed plugin options.

A plugin declares its manifest options as a subclass of :class:`Options`, a pydantic model, with a
type, a default and a help text for each field. Unknown keys and wrong types are refused, and the
error names the manifest key. Fields typed ``Path`` are resolved against the manifest's folder.

Values must have the declared type; nothing is converted: ``16`` for an ``int`` (not ``"16"``, nor
``16.0``), ``true``/``false`` only for a ``bool`` (never for a number), a number for a ``float`` (an
integer such as ``1`` is one). Lists and tuples check their items. Pydantic's own strict mode would
also refuse a TOML list for a tuple and a string for a ``Path``, so the check is ours (``_mismatch``).
"""

import json
import os
import tomllib
import types
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pydantic
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from lmlab.api.errors import UserError

__all__ = ["Options", "Field", "refuse_moved"]

#: The error type of a value of the wrong type; its message already says what was given.
TYPE_ERROR = "option_type"


def Field(default: Any = ..., *, help: str = "", **constraints: Any) -> Any:
    """A documented option: ``lr: float = Field(1e-3, gt=0, help="peak learning rate")``.

    ``constraints`` are pydantic's (gt, ge, lt, le, min_length, pattern, ...).
    """
    return pydantic.Field(default, description=help, **constraints)


class Options(BaseModel):
    """Base class of every plugin's options (and of the core's ``[model]`` and ``[train]`` tables)."""

    # allow_inf_nan: an infinite or NaN learning rate (or any other number) is a typo, never a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _check_type_and_resolve_paths(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is None:
            return value
        # Before pydantic's lax conversions, which would read "16" as 16 and true as 1.0, and before
        # the bounds, which would call `true` "less than 2".
        problem = _mismatch(field.annotation, value)
        if problem:
            raise PydanticCustomError(TYPE_ERROR, "{problem}", {"problem": problem})
        # Relative paths in a manifest mean "next to the manifest", not "next to the shell".
        base = (info.context or {}).get("base_dir")
        if base is None or not isinstance(value, str) or not _is_path_type(field.annotation):
            return value
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else Path(base) / path)


def refuse_moved(table: str, values: Any, where: str, instead: dict[str, str]) -> None:
    """Refuse, in one line, a key of ``table`` that an API version moved to ``where``: ``instead`` maps
    each such key to what to write now, in which ``{value}`` stands for the value given. Nothing when
    ``values`` (the table as the manifest gives it) has none. Called from an Options class's
    ``model_validator(mode="before")``: a refusal that names the new spelling fixes an old manifest in
    one edit, where "unknown option" would leave the user searching."""
    if not isinstance(values, dict):
        return
    for key, spelling in instead.items():
        if key in values:
            shown = json.dumps(values[key]) if isinstance(values[key], (str, bool, list)) else str(values[key])
            raise UserError(f"moved to {where}: write {spelling.replace('{value}', shown)}", key=f"{table}.{key}")


def _is_path_type(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return True
    # Optional[Path], Annotated[Path, ...] and FilePath carry Path in their arguments or origin.
    args = getattr(annotation, "__args__", ()) or ()
    origin = getattr(annotation, "__origin__", None)
    return any(_is_path_type(a) for a in (*args, origin) if a is not None and a is not annotation)


def _mismatch(annotation: Any, value: Any) -> str | None:
    """Why ``value`` is not of the declared type (a Literal's type is its choices), or None when it
    is. Bounds and lengths are left to pydantic."""
    if _fits(annotation, value):
        return None
    expected = _describe(annotation)
    sequences = [a for a in _arms(annotation) if _item_types(a) is not None]
    if isinstance(value, (list, tuple)) and len(sequences) == 1:
        for index, (item_type, item) in enumerate(zip(_item_types(sequences[0], len(value)), value), 1):
            if not _fits(item_type, item):
                return f"expected {expected}; item {index} is {_shown(item)}{_hint(item_type, item)}"
    return f"expected {expected}, got {_shown(value)}{_hint(annotation, value)}"


def _arms(annotation: Any) -> list:
    """The alternatives of a union (Optional included), Annotated's metadata dropped."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [arm for a in get_args(annotation) for arm in _arms(a)]
    return [annotation]


def _item_types(annotation: Any, length: int = 0) -> list | None:
    """The item types of a list or tuple type (None for any other), for a value of ``length`` items."""
    origin = get_origin(annotation) or annotation
    if not (isinstance(origin, type) and issubclass(origin, (list, tuple, set, frozenset))):
        return None
    args = get_args(annotation)
    if origin is tuple and args and args[-1] is not Ellipsis:
        # A tuple of the wrong length fits no item list; pydantic reports the length.
        return list(args) if len(args) == length else [Any] * length
    return [args[0] if args else Any] * length


def _fits(annotation: Any, value: Any) -> bool:
    arms = _arms(annotation)
    if len(arms) > 1:
        return any(_fits(arm, value) for arm in arms)
    annotation = arms[0]
    if annotation is Any or annotation is object:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    if get_origin(annotation) is Literal:  # exactly a choice: in a union, pydantic would turn "2" into 2
        return any(_same_kind(value, choice) and value == choice for choice in get_args(annotation))
    items = _item_types(annotation, len(value) if isinstance(value, (list, tuple)) else 0)
    if items is not None:
        return isinstance(value, (list, tuple)) and all(_fits(t, v) for t, v in zip(items, value))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return isinstance(value, (str, os.PathLike))
    return True  # a type this check does not know (a model, an enum class, a dict): pydantic's business


def _same_kind(value: Any, choice: Any) -> bool:
    if isinstance(choice, Enum):
        return isinstance(value, (type(choice), type(choice.value)))
    if isinstance(choice, bool) or isinstance(value, bool):
        return isinstance(choice, bool) and isinstance(value, bool)
    return isinstance(value, type(choice))


#: What a value of each type is called: (singular, plural).
_NAMES = {bool: ("a boolean (true or false)", "booleans (true or false)"), int: ("an integer", "integers"),
          float: ("a number (float)", "numbers (float)"), str: ("a string", "strings")}


def _describe(annotation: Any, plural: bool = False) -> str:
    arms = [a for a in _arms(annotation) if a is not type(None)]
    if len(arms) != 1:
        return " or ".join(dict.fromkeys(_describe(a, plural) for a in arms)) or "nothing"
    annotation = arms[0]
    if get_origin(annotation) is Literal:
        choices = [_toml(c.value if isinstance(c, Enum) else c) for c in get_args(annotation)]
        return choices[0] if len(choices) == 1 else "one of " + ", ".join(choices)
    if _item_types(annotation) is not None:
        args = get_args(annotation)
        fixed = get_origin(annotation) is tuple and args and args[-1] is not Ellipsis
        if fixed and len(set(args)) > 1:
            return ("lists" if plural else "a list") + " of (" + ", ".join(_describe(a) for a in args) + ")"
        count = f"{len(args)} " if fixed else ""
        return ("lists" if plural else "a list") + f" of {count}" + (_describe(args[0], True) if args else "values")
    if annotation in _NAMES:
        return _NAMES[annotation][plural]
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "paths (strings)" if plural else "a path (a string)"
    return getattr(annotation, "__name__", str(annotation))


def _shown(value: Any) -> str:
    """A value as the manifest wrote it, with what TOML calls its type."""
    if isinstance(value, bool):
        return f"the boolean {_toml(value)}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the float {value!r}"
    if isinstance(value, str):
        return f"the string {_toml(value if len(value) <= 60 else value[:57] + '...')}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return "nothing (None)" if value is None else f"{value!r} (a {type(value).__name__})"


def _toml(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # "text", 3, 0.5, true: as TOML writes them


def _hint(annotation: Any, value: Any) -> str:
    """How to write ``value`` so that it has the declared type, when quotes are all it takes: "3e-4"
    for a float, "16" for an integer, "true" for a boolean; 2024 for a string (``--set`` reads a
    value as TOML, so ``--set data.path=2024`` gives an integer)."""
    if isinstance(value, (bool, int, float)) and _fits(annotation, _toml(value)):
        return f"; quote it ({json.dumps(_toml(value))}) if it is meant as text"
    if not isinstance(value, str) or not value or value != value.strip() or "\n" in value or "=" in value:
        return ""
    try:
        unquoted = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return ""
    return "; drop the quotes" if not isinstance(unquoted, str) and _fits(annotation, unquoted) else ""
