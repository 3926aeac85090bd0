"""A variant, assembled: the one place that turns a resolved :class:`~lmlab.variant.Variant` into its
plugins, fitted tokenizer, vocabulary, model shape and model (and, for a trained run, its weights).

Every consumer goes through :func:`assemble`: ``lmlab run`` (with the prepared corpus, the ``[init]``
weights and the adapter: the model it trains), ``lmlab plan`` (on fake tensors), ``lmlab check`` (on
the meta device, to run the plugins' checks), and a trained run loaded back for ``generate``,
``eval``, ``merge`` and ``rerun`` (its compressed structure, base weights and adapter). Each piece is
built exactly once; :meth:`Assembly.build_model` builds another copy of the same model for the
callers that need one (a sharded run's main process gathers the weights into one, the planner
measures one per dtype, with the adapter in place).

The tokenizer comes from one of four places: the token cache, fitted on the variant's training split
(``data=True``, what a run trains on; a fine-tune's is the ``[init]`` run's own, loaded instead of
fitted); a trained run's ``tokenizer/`` folder (``run_dir``); the plugin itself when it knows its
vocabulary unfitted (bytes, a pretrained tokenizer file); else, for planning, the token cache again.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmlab.api import ModelShape, UserError, Vocabulary
from lmlab.api.architecture import ENCODER_DECODER
from lmlab.model import LanguageModel, build_model, default_plugin, family, shape_of

#: ``vocab_size`` of the shape ``lmlab check`` builds on the meta device when the tokenizer cannot say
#: its own without being fitted on the data (a char vocabulary): checks that need the real one wait for
#: the run.
UNKNOWN_VOCABULARY = 256


@dataclass
class Assembly:
    """A variant's pieces, each built once."""

    variant: Any  # lmlab.variant.Variant
    plugins: dict[str, Any]  # slot → plugin instance (many-valued slots: a list)
    tokenizer: Any  # fitted (None: not known without the data, in a check)
    vocab: Vocabulary
    shape: ModelShape
    model: LanguageModel | None = None
    tokens: Any = None  # lmlab.prepare.tokens.TokenData, when assembled with data
    checkpoint: Path | None = None  # a trained run: the file its weights came from
    step: int | None = None  # and its step
    peft: Any = None  # the applied peft plugin (None without an adapter)
    adapter: Any = None  # a training run's lmlab.train.adapters.PeftRun (None without an adapter)
    init: dict | None = None  # a training run's record of where its [init] weights came from

    @property
    def objective(self):
        return self.plugins["objective"]

    def build_model(self, adapted: bool = False) -> LanguageModel:
        """A new model of the variant (fresh weights on the current default device); ``adapted``: with
        the variant's peft adapter applied, as the run trains it."""
        model = build_model(self.variant.model, self.shape, self.plugins, self.vocab.decoder_start_id)
        peft = self.plugins.get("peft")
        if adapted and peft is not None:
            peft.apply(model, self.variant)
        return model


def assemble(variant, *, data: bool = False, run_dir: Path | None = None, model: bool = True,
             vocabulary_unknown_ok: bool = False, plugins: dict | None = None, train_dir: Path | None = None,
             resuming: bool = False) -> Assembly:
    """``variant`` assembled: ``data`` prepares the corpus (the token cache) and takes the tokenizer fitted
    on it; ``run_dir`` loads a trained run's tokenizer and the weights of its best (else last) checkpoint;
    ``train_dir``: the model a run trains into that folder, with its ``[init]`` weights and its adapter
    (``resuming``: it continues from its own checkpoint, which restores the weights; a PEFT run's base
    comes back from the folder first). ``model=False`` stops before the model.
    ``vocabulary_unknown_ok``: never prepare the data for the tokenizer (``lmlab check``), taking a
    stand-in vocabulary when it cannot say its own unfitted. ``plugins``: the variant's plugin
    instances, when the caller made them already (the checks)."""
    plugins = plugins if plugins is not None else {slot: variant.instantiate(slot) for slot in variant.slots}
    tokenizer, tokens = plugins["tokenizer"], None
    if run_dir is not None:
        load_tokenizer(tokenizer, variant, Path(run_dir))
    elif data or (not vocabulary_unknown_ok and not knows_vocabulary(tokenizer)
                  and _vocabulary_from_tokenizer(variant.model, plugins["objective"])):
        from lmlab.prepare.tokens import load_tokens

        tokens = load_tokens(variant, tokenizer=tokenizer)  # fitted on the data (or the [init]'s), or cached
        if plugins["objective"].sampling == "windows":
            check_windows_fit(tokens, variant.model.block_size)
    elif not knows_vocabulary(tokenizer):
        tokenizer = None  # planned or checked from model.vocab_size, or a stand-in (see vocabulary)
    shape, vocab = vocabulary(variant.model, plugins["objective"], tokenizer, plugins["architecture"])
    plugins["objective"].setup(vocab)
    out = Assembly(variant, plugins, tokenizer, vocab, shape, tokens=tokens)
    if model:
        if run_dir is not None:
            from lmlab.unfilled import without_random_init

            # Every parameter comes from the checkpoint (a loaded objective's own new heads excepted,
            # which the load starts itself): nothing is drawn that the load would throw away.
            with without_random_init(parameters_only=True):
                out.model = out.build_model()
            _load_trained_weights(out, Path(run_dir))
        else:
            out.model = out.build_model()
            if train_dir is not None:
                _finish_for_training(out, Path(train_dir), resuming)
    return out


def _finish_for_training(out: Assembly, run_dir: Path, resuming: bool) -> None:
    from lmlab import pretrained
    from lmlab.train import adapters

    # [init]: the weights a fine-tune starts from, loaded before anything adapts, wraps or shards the model.
    out.init = pretrained.initialise(out.variant, out.model, run_dir, resuming=resuming)
    # [peft]: the adapter goes in on top of those weights and freezes them.
    out.adapter = adapters.apply_peft(out.plugins.get("peft"), out.model, out.variant, run_dir / "checkpoints",
                                      resuming=resuming)
    out.peft = out.adapter.plugin if out.adapter is not None else None


def check_windows_fit(tokens, block_size: int) -> None:
    """Each split holds at least one window of block_size + 1 tokens (training draws from a range
    one longer), or the run is refused before it starts."""
    for split, needs in (("train", block_size + 2), ("val", block_size + 1)):
        held = len(getattr(tokens, split))
        if held < needs:
            raise UserError(f"the {split} split of the data holds {held:,} tokens, fewer than a window of "
                            f"block_size + 1 = {block_size + 1} needs; use more data or a smaller model.block_size",
                            key="model.block_size")


def knows_vocabulary(tokenizer) -> bool:
    """Whether the tokenizer can say its vocabulary size before it is fitted (a byte tokenizer can; a
    character vocabulary is learnt from the data)."""
    try:
        tokenizer.vocab_size  # noqa: B018
    except Exception:  # noqa: BLE001 — an unfitted tokenizer may fail in any way; fitting settles it
        return False
    return True


def load_tokenizer(tokenizer, variant, run_dir: Path) -> None:
    """Load a trained run's fitted tokenizer (``tokenizer/``) into ``tokenizer``; a UserError naming the
    folder when it is missing or cannot be read."""
    folder = run_dir / "tokenizer"
    if not folder.is_dir():
        raise UserError("is missing: a run writes its fitted tokenizer there when it starts (was the folder "
                        "copied without it?)", key=str(folder))
    try:
        tokenizer.load(folder)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot be read by the {variant.slots['tokenizer'].name} tokenizer "
                        f"({type(exc).__name__}: {exc})", key=str(folder)) from None


def _load_trained_weights(out: Assembly, run_dir: Path) -> None:
    from lmlab.checkpoint import best_or_last
    from lmlab.train import adapters

    out.checkpoint = best_or_last(run_dir)
    out.step, out.peft = adapters.load_run_weights(out.model, out.variant, run_dir, out.checkpoint)
    out.model.eval()


# -- the pieces -------------------------------------------------------------------------------------

def model_shape(model, tokenizer_vocab: int | None, reserved: int = 0) -> ModelShape:
    """The shape of the model ``model`` (``[model]``, a ModelOptions) describes; ``reserved``: ids past
    the tokenizer's vocabulary that the objective's special tokens take (see :func:`vocabulary`).
    ``tokenizer_vocab`` None: not known before the data is read (``lmlab check``)."""
    if tokenizer_vocab is None:
        return shape_of(model, model.vocab_size or UNKNOWN_VOCABULARY + reserved)
    vocab = model.vocab_size or tokenizer_vocab + reserved
    if vocab < tokenizer_vocab + reserved:
        needs = f" plus the objective's {reserved} special token(s)" if reserved else ""
        raise UserError(f"{vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}){needs}",
                        key="model.vocab_size")
    return shape_of(model, vocab)


def special_ids(objective, tokenizer) -> dict[str, int]:
    """name → id of each of the objective's special tokens: the tokenizer's own when it has one, else
    the next id past its vocabulary (in the order the objective names them), so that the ids of a
    run are a function of its tokenizer and objective alone and a checkpoint reloads with them."""
    special, next_id = {}, tokenizer.vocab_size
    for name in objective.special_tokens:
        own = tokenizer.special_id(name)
        if own is None:
            own, next_id = next_id, next_id + 1
        special[name] = own
    return special


def vocabulary(model, objective, tokenizer, architecture=None) -> tuple[ModelShape, Vocabulary]:
    """The model shape, with room for the objective's special tokens, and the Vocabulary the objective
    is set up with (``architecture``: the variant's plugin, by default the slot's default one). ``tokenizer`` None (not fitted: planning or checking without the data):
    ``model.vocab_size`` when it decides alone, else a stand-in size (:data:`UNKNOWN_VOCABULARY`)."""
    if architecture is None:
        architecture = default_plugin("architecture")
    if tokenizer is None:
        if not _vocabulary_from_tokenizer(model, objective):
            size = model.vocab_size
            return model_shape(model, size), Vocabulary(size=size, tokenizer_size=size,
                                                        decoder_start_id=decoder_start(architecture, objective, None))
        names = tuple(objective.special_tokens)
        shape = model_shape(model, None, len(names))
        special = {name: UNKNOWN_VOCABULARY + i for i, name in enumerate(names)}
        return shape, Vocabulary(size=shape.vocab_size, tokenizer_size=UNKNOWN_VOCABULARY, special=special,
                                 decoder_start_id=decoder_start(architecture, objective, None))
    special = special_ids(objective, tokenizer)
    reserved = sum(1 for i in special.values() if i >= tokenizer.vocab_size)
    shape = model_shape(model, tokenizer.vocab_size, reserved)
    return shape, Vocabulary(size=shape.vocab_size, tokenizer_size=tokenizer.vocab_size, special=special,
                             eos_id=tokenizer.eos_id, decoder_start_id=decoder_start(architecture, objective, tokenizer.eos_id))


def decoder_start(architecture, objective, eos_id: int | None) -> int | None:
    """The id an encoder-decoder model's decoder starts from (``Architecture.decoder_start_id``, given
    the end-of-document id); None for the other families."""
    if family(architecture, objective) != ENCODER_DECODER:
        return None
    return architecture.decoder_start_id(eos_id)


def _vocabulary_from_tokenizer(model, objective) -> bool:
    """Whether the model's vocabulary depends on the tokenizer: not when ``model.vocab_size`` is set and
    the objective reserves no special token that might take the tokenizer's ids."""
    return not model.vocab_size or bool(objective.special_tokens)
