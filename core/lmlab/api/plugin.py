"""The base class every plugin derives from, through its slot's base class."""

from typing import ClassVar

from lmlab.api.options import Options


class Plugin:
    """One implementation of one slot, registered under the entry-point group ``lmlab.<slot>``.

    Subclasses set ``Options`` to their options model and may narrow ``api``, the range of
    ``lmlab.api`` versions they work with (a PEP 440 specifier). Discovery sets ``name`` (the entry
    point's name, which is what manifests write) and checks the class before it is used. Each slot's
    base class ([SLOT_BASES][lmlab.api]) says which methods the core calls, when, and with what.
    Any plugin may also implement the lifecycle hooks of [LifecycleSpec][lmlab.api.hooks.LifecycleSpec].

    The core makes instances as it needs them, several per variant (for the checks, for the run in
    each of its processes, in each worker process of a preparation, for ``lmlab generate``), each
    from the options validated from the variant's manifest table, and uses an instance for one
    variant only.

    Args:
        options: The plugin's validated options; None for the defaults (``self.Options()``).
    """

    slot: ClassVar[str] = ""
    """The slot this class belongs to, set by each slot's base class (``"attention"``, ...)."""
    Options: ClassVar[type[Options]] = Options
    """The plugin's options model, an [Options][lmlab.api.options.Options] subclass: the fields of
    its manifest table (``[attention]`` or, for many-valued slots, ``[filter.NAME]``)."""
    api: ClassVar[str] = ">=1.0,<2"
    """The ``lmlab.api`` versions the plugin works with (a PEP 440 specifier); discovery refuses it
    when [API_VERSION][lmlab.api.version.API_VERSION] is outside."""
    name: ClassVar[str] = ""
    """The entry point's name, set by discovery: what manifests write in ``use``."""
    free_options: ClassVar[frozenset[str]] = frozenset()
    """Options of a plugin that builds the model (architecture, position, attention, ffn) that a run
    starting from an ``[init]`` may set otherwise than the init did (API 1.19): they change no weight
    the init holds (a decoding setting; heads the model starts itself). Every other option must agree
    with the init's, or the run is refused naming it."""

    def __init__(self, options: Options | None = None):
        self.options = options if options is not None else self.Options()
        """This instance's options: an instance of ``Options``, frozen."""

    def check(self, context) -> None:
        """Refuse, before anything is built or read, a setting this plugin cannot work with in this
        variant (API 1.6).

        Called for each variant by ``lmlab check``, and by ``lmlab run`` before it prepares any
        data (for every variant first, then again as each starts): raise a ``UserError`` naming the
        manifest key, judging against the model's shape, the other plugins and this machine
        (when ``context.machine``). Allocate nothing and read no data. Default: nothing to check.

        Args:
            context: The variant: a [CheckContext][lmlab.api.check.CheckContext].
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"
