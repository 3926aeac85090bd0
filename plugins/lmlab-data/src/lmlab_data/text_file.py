"""Plain text files as documents: one document per file, or per separator within each file.

One file alone is nanoGPT's tiny-shakespeare setup: a single document whose last ``val_fraction`` of
characters is the validation split. Several files (a list, or glob patterns such as
``src/**/*.py``) are several documents, taken in sorted path order; with ``separator`` each file is
split further, as a corpus of ``<|endoftext|>``-separated documents is. Files are streamed: with a
separator, a file larger than memory works (each document must fit). The fingerprint hashes the file
names and bytes, so editing a file invalidates the token cache.
"""

from typing import Iterator

from lmlab.api import Field
from lmlab_data.files import CHUNK, READ_ERRORS, FileSource, FilesOptions, open_text, read_error


class TextFileOptions(FilesOptions):
    separator: str = Field("", help="split each file into documents at this string (e.g. \"<|endoftext|>\"); "
                                    "empty: one document per file")


class TextFile(FileSource):
    Options = TextFileOptions
    yields_records = False  # API 1.6: what an objective can check before reading
    api = ">=1.6,<2"  # yields_records; stats (1.3)

    def __init__(self, options: TextFileOptions | None = None):
        super().__init__(options)
        self.skipped = 0

    def documents(self) -> Iterator[str]:
        self.skipped = 0
        o = self.options
        for path in self.files():
            try:
                with open_text(path, o.encoding) as f:
                    if o.separator:
                        # A failure partway keeps the documents before it (already yielded).
                        yield from _split(f, o.separator)
                    elif text := f.read():  # an empty file is no document
                        yield text
            except READ_ERRORS as exc:
                if o.bad_file == "fail":
                    raise read_error(path, o.encoding, exc) from exc
                self.skipped += 1


    def stats(self) -> dict[str, int]:
        return {"files_skipped": self.skipped} if self.skipped else {}


def _split(f, separator: str) -> Iterator[str]:
    """The pieces of a text stream between separators, read a chunk at a time; blank ones dropped."""
    rest = ""
    while chunk := f.read(CHUNK):
        pieces = (rest + chunk).split(separator)
        rest = pieces.pop()
        for piece in pieces:
            if piece.strip():
                yield piece
    if rest.strip():
        yield rest
