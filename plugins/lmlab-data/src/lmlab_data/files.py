"""What the file-reading data sources share: file lists from paths and glob patterns, the fingerprint of
their contents, and reading errors turned into one-line user errors that name the file.

``path`` takes one string or a list; each is a file or a glob pattern (``**`` spans folders), relative
to the manifest's folder. The files are taken in sorted order, each once, so the corpus's order (and
with it the validation split) does not depend on the file system's listing order.
"""

import codecs
import fnmatch
import glob
import gzip
import hashlib
import io
import os
from pathlib import Path
from typing import IO, Iterator, Literal

from pydantic import ValidationInfo, field_validator

from lmlab.api import DataOptions, DataSource, Field, UserError

CHUNK = 1 << 20  # read and hash in 1 MiB pieces: a corpus need not fit in memory


class FilesOptions(DataOptions):
    path: str | list[str] = Field(..., help="a file, a glob pattern ('corpus/**/*.txt') or a list of them; "
                                            "relative to the manifest")
    exclude: list[str] = Field([], help="glob patterns of files to leave out, matched against the full path "
                                        "(e.g. '*/test/*')")
    encoding: str = Field("utf-8", help="the files' text encoding")
    bad_file: Literal["fail", "skip"] = Field(
        "fail", help='a file that cannot be read or decoded: "fail" stops with its name, "skip" leaves it out')

    @field_validator("path", mode="before")
    @classmethod
    def _absolute(cls, value, info: ValidationInfo):
        # Relative paths mean "next to the manifest", as for Path-typed options.
        base = (info.context or {}).get("base_dir")
        items = value if isinstance(value, (list, tuple)) else [value]
        if not items:
            raise ValueError("names no file")
        out = []
        for item in items:
            if not isinstance(item, (str, os.PathLike)):
                return value  # pydantic's own type error names it
            path = Path(item).expanduser()
            out.append(str(path if path.is_absolute() or base is None else Path(base) / path))
        return out if isinstance(value, (list, tuple)) else out[0]

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        try:
            codec = codecs.lookup(value)
        except LookupError:
            raise ValueError(f"unknown encoding {value!r}") from None
        if not getattr(codec, "_is_text_encoding", True):  # rot13, base64, zlib: codecs, not text encodings
            raise ValueError(f"{value!r} is not a text encoding (utf-8, latin-1, cp1252, ...)")
        return value

    @field_validator("path")
    @classmethod
    def _matches_files(cls, value):
        for pattern in ([value] if isinstance(value, str) else value):
            if glob.has_magic(pattern):
                if next(expand(pattern), None) is None:
                    raise ValueError(f"no file matches {pattern!r}")
            elif os.path.isdir(pattern):
                raise ValueError(f"{pattern!r} is a folder; name its files with a pattern such as "
                                 f"'{os.path.join(pattern, '**', '*.txt')}'")
            elif not os.path.exists(pattern):
                raise ValueError(f"no such file: {pattern!r}")
        return value

    def files(self) -> list[Path]:
        """Every file the options name, sorted, each once, without the excluded ones."""
        found: set[str] = set()
        for pattern in ([self.path] if isinstance(self.path, str) else self.path):
            found.update(expand(pattern, self.exclude) if glob.has_magic(pattern) else [pattern])
        keep = (p for p in found if not _excluded(p, self.exclude))
        return [Path(p) for p in sorted(keep)]


def expand(pattern: str, exclude: list[str] = ()) -> Iterator[str]:
    """The files matching a glob pattern (``**`` for any number of folders; names starting with a dot
    only when the pattern says so, as :mod:`glob`), without walking into folders that ``exclude``
    leaves out whole (a pattern such as ``*/site-packages/*``)."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    yield from _match(os.path.join(*parts[:fixed]) if fixed else ".", parts[fixed:], exclude)


def _match(directory: str, rest: tuple[str, ...], exclude) -> Iterator[str]:
    if not rest:
        if os.path.isfile(directory):
            yield directory
        return
    head, tail = rest[0], rest[1:]
    try:
        entries = list(os.scandir(directory))
    except OSError:  # not a folder, or unreadable: nothing matches below it
        return
    if head == "**":
        if not tail:  # a pattern ending in ** matches every file below
            for entry in entries:
                if entry.is_file() and not entry.name.startswith("."):
                    yield entry.path
        yield from _match(directory, tail, exclude)  # no folder at all
        for entry in entries:
            if entry.is_dir() and not entry.name.startswith(".") and not _excluded(entry.path + os.sep, exclude):
                yield from _match(entry.path, rest, exclude)
        return
    for entry in entries:
        if fnmatch.fnmatchcase(entry.name, head) and (head.startswith(".") or not entry.name.startswith(".")):
            if tail and (not entry.is_dir() or _excluded(entry.path + os.sep, exclude)):
                continue
            yield from _match(entry.path, tail, exclude)


def _excluded(path: str, exclude) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern in exclude)


def open_text(path: Path, encoding: str) -> IO[str]:
    """The file as text; ``.gz`` files are decompressed as they are read."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding=encoding, newline="")
    return open(path, encoding=encoding, newline="")


def read_error(path: Path, encoding: str, exc: Exception) -> UserError:
    """A reading failure as the one-line error the user sees."""
    if isinstance(exc, UnicodeDecodeError):
        why = f"is not valid {encoding} ({exc.reason} at byte {exc.start}); set data.encoding, or"
    else:
        why = f"cannot be read ({getattr(exc, 'strerror', None) or exc});"
    return UserError(f"{path} {why} set bad_file = \"skip\" to leave such files out", key="data.path")


READ_ERRORS = (OSError, UnicodeDecodeError, EOFError)  # EOFError: a truncated .gz


class FileSource(DataSource):
    """A data source that reads the files its options name. The file list is taken once per instance,
    so the fingerprint and the documents always agree on it (and a large tree is walked once)."""

    def files(self) -> list[Path]:
        if getattr(self, "_files", None) is None:
            self._files = self.options.files()
        return self._files

    def parts(self, size: int) -> list[tuple[str, ...]]:
        """Runs of consecutive files of about ``size`` bytes together (API 1.16): each file is read
        whole by one worker, as ``documents`` reads it, so a part yields what ``documents`` does for
        its files and a file read partway before an error keeps the same documents."""
        out, run, total = [], [], 0
        for path in self.files():
            try:
                bytes_ = os.stat(path).st_size
            except OSError:  # reported by the worker that reads it, as documents() would
                bytes_ = 0
            run.append(str(path))
            total += bytes_
            if total >= size:
                out.append(tuple(run))
                run, total = [], 0
        if run:
            out.append(tuple(run))
        return out

    def documents_in(self, part: tuple[str, ...]):
        """The documents of the files of one part, in order (this instance reads only those)."""
        self._files = [Path(p) for p in part]
        return self.documents()

    def fingerprint(self) -> str:
        """SHA-256 of the options, the file names and their bytes."""
        digest = hashlib.sha256(super().fingerprint().encode())
        for path in self.files():
            digest.update(f"\0{path}\0".encode())
            try:
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        digest.update(chunk)
            except OSError as exc:
                if self.options.bad_file == "fail":
                    raise read_error(path, self.options.encoding, exc) from exc
                digest.update(b"\0unreadable\0")
        return digest.hexdigest()
