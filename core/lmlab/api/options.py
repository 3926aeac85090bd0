"""Typed plugin options.

A plugin declares its manifest options as a subclass of :class:`Options`, a pydantic model, with a
type, a default and a help text for each field. Unknown keys and wrong types are refused, and the
error names the manifest key. Fields typed ``Path`` are resolved against the manifest's folder.
"""

from pathlib import Path
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

__all__ = ["Options", "Field"]


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
    def _resolve_relative_paths(cls, value: Any, info: ValidationInfo) -> Any:
        # Relative paths in a manifest mean "next to the manifest", not "next to the shell".
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        base = (info.context or {}).get("base_dir")
        if base is None or field is None or not isinstance(value, str) or not _is_path_type(field.annotation):
            return value
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else Path(base) / path)


def _is_path_type(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return True
    # Optional[Path], Annotated[Path, ...] and FilePath carry Path in their arguments or origin.
    args = getattr(annotation, "__args__", ()) or ()
    origin = getattr(annotation, "__origin__", None)
    return any(_is_path_type(a) for a in (*args, origin) if a is not None and a is not annotation)
