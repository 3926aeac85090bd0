"""The data slot: where the training text comes from."""

import hashlib
import json
from typing import Iterable

from lmlab.api.options import Field, Options
from lmlab.api.plugin import Plugin


class DataOptions(Options):
    """Options every data source has."""

    val_fraction: float = Field(0.1, gt=0, lt=1, help="share of the corpus held out for validation (its end)")


class DataSource(Plugin):
    """Yields documents; the core tokenises them once and caches the tokens.

    The validation split is the last ``val_fraction`` of the corpus: of the characters when there
    is one document, of the documents otherwise.
    """

    slot = "data"
    Options = DataOptions

    def documents(self) -> Iterable[str]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A string that changes whenever the documents change; part of the token-cache key.

        The default hashes the options; sources that read files should also hash their contents.
        """
        blob = json.dumps(self.options.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(f"{self.name}:{blob}".encode()).hexdigest()
