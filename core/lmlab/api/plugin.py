"""The base class every plugin derives from, through its slot's base class."""

from typing import ClassVar

from lmlab.api.options import Options


class Plugin:
    """One implementation of one slot, registered under the entry-point group ``lmlab.<slot>``.

    Subclasses set ``Options`` to their options model and may narrow ``api``, the range of
    ``lmlab.api`` versions they work with (a PEP 440 specifier). Discovery sets ``name`` (the entry
    point's name, which is what manifests write) and checks the class before it is used.
    """

    slot: ClassVar[str] = ""
    Options: ClassVar[type[Options]] = Options
    api: ClassVar[str] = ">=1.0,<2"
    name: ClassVar[str] = ""

    def __init__(self, options: Options | None = None):
        self.options = options if options is not None else self.Options()

    def check(self, context) -> None:
        """Called before anything is built or read, by ``lmlab check`` and by ``lmlab run`` before it
        prepares the data (API 1.6): refuse, with a ``UserError`` naming the manifest key, a setting
        this plugin cannot work with in this variant — against the model's shape, the other plugins,
        this machine (``context``: a :class:`lmlab.api.CheckContext`). Default: nothing to check."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"
