"""One text file as one document — nanoGPT's tiny-shakespeare setup.

The validation split is the end of the file (``val_fraction`` of its characters, see
``lmlab.api.DataSource``). The fingerprint hashes the file's bytes, so editing the file
invalidates the token cache even when its path and size stay the same.
"""

import hashlib
from typing import Iterator

from pydantic import FilePath

from lmlab.api import DataOptions, DataSource, Field, UserError

CHUNK = 1 << 20  # hash in 1 MiB pieces: a corpus need not fit in memory twice


class TextFileOptions(DataOptions):
    # FilePath: a missing file (or a folder) is a validation error on this key. The core resolves
    # a relative path against the manifest's folder before validation.
    path: FilePath = Field(..., help="the text file; relative paths are relative to the manifest")
    encoding: str = Field("utf-8", help="the file's text encoding")


class TextFile(DataSource):
    Options = TextFileOptions

    def documents(self) -> Iterator[str]:
        try:
            yield self.options.path.read_text(encoding=self.options.encoding)
        except (UnicodeDecodeError, LookupError) as e:  # bad bytes, or an unknown encoding name
            raise UserError(f"cannot read {self.options.path} as {self.options.encoding}: {e}",
                            key="data.encoding") from e

    def fingerprint(self) -> str:
        digest = hashlib.sha256(super().fingerprint().encode())  # the options
        with open(self.options.path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return digest.hexdigest()
