"""Checks before training: what a variant's plugins cannot do together, found by ``lmlab check`` and by
``lmlab run`` before it reads any data, each as one UserError naming the manifest key.

The core checks its own rule (a PEFT method names the parallel plugins it runs under); every plugin
then checks itself against the shape, the other plugins and this machine (``Plugin.check``, API 1.6);
and the model is built once on the meta device, where the core refuses a bidirectional objective with
an attention plugin that attends one way only, a plugin's ``build`` refuses what its options cannot
do with the shape, and plugins that need the modules (PEFT targets, tensor-parallel plans) look at
them. Nothing here allocates a tensor's memory. The data is read only when a setting depends on
the vocabulary a tokenizer learns from it (``model.vocab_size``, a ``train.sample_prompt`` you set):
then the tokenizer is fitted through the token cache, which the run reuses; otherwise such a
vocabulary stays unknown here (a stand-in size).
"""

from lmlab import objective_runs
from lmlab.api import CheckContext, UserError
from lmlab.assemble import assemble
from lmlab.config import TrainOptions
from lmlab.unfilled import without_random_init

DEFAULT_SAMPLE_PROMPT = TrainOptions.model_fields["sample_prompt"].default


def run(variant, machine: bool = True) -> CheckContext:
    """Run every check of ``variant``; returns the context the plugins saw."""
    import torch

    plugins = {slot: variant.instantiate(slot) for slot in variant.slots}
    fit = _needs_fitted_tokenizer(variant, plugins)
    built = assemble(variant, model=False, data=fit, vocabulary_unknown_ok=not fit, plugins=plugins)
    if plugins.get("compress"):
        # A [compress] table records how a run folder's weights were compressed (lmlab compress); training
        # from it would silently ignore it.
        raise UserError("names compress methods: a manifest that trains cannot; train, then run `lmlab compress "
                        "RUN_DIR --use METHOD` on the trained run (or start from a compressed run with [init])",
                        key="compress.use")
    peft = plugins.get("peft")
    if peft is not None:
        from lmlab.train.adapters import check_parallel

        check_parallel(peft, variant)
    try:
        with torch.device("meta"), without_random_init():
            model = built.build_model()  # the core and the plugins' build methods refuse here
    except UserError:
        raise
    except (NotImplementedError, RuntimeError, TypeError, ValueError):
        model = None  # a module that cannot be built on the meta device is checked when the run builds it
    context = CheckContext(shape=built.shape, plugins=plugins, manifest=variant.manifest, model=model,
                           vocabulary_known=built.tokenizer is not None, machine=machine, run=variant)
    for slot, value in plugins.items():
        for plugin in value if isinstance(value, list) else [value]:
            plugin.check(context)
            _check_components(plugin, slot, context)
    if built.tokenizer is not None:
        check_sample_prompt(variant.train, plugins["objective"], built.tokenizer)
    _check_objective_runs_model(plugins, model)
    _check_order(variant, plugins.get("order"), plugins["objective"])
    objective_runs.check(variant, plugins["objective"], built.tokenizer)
    return context


def _check_components(plugin, key: str, context: CheckContext) -> None:
    """The plugins ``plugin``'s nested tables name check themselves too; a refusal that names their
    slot's key (``attention.n_kv_heads``) is told at the table it came from
    (``architecture.mixers.A.n_kv_heads``)."""
    from lmlab.variant import components_of

    declared = getattr(type(plugin), "components", None) or {}
    for field, built in components_of(plugin).items():
        slot = declared.get(field, "")
        for label, inner in built.items():
            where = f"{key}.{field}.{label}"
            try:
                inner.check(context)
            except UserError as exc:
                if exc.key and (exc.key == slot or exc.key.startswith(f"{slot}.")):
                    raise UserError(exc.message, key=where + exc.key[len(slot):]) from None
                raise
            _check_components(inner, where, context)


def _samples_prompt(train, objective) -> bool:
    """Whether the closing sample starts from a prompt the user chose. The default one (a line break)
    may not encode (a corpus without any): then only the sample is lost, with a warning at the end."""
    return bool(train.sample_tokens) and objective.causal and train.sample_prompt != DEFAULT_SAMPLE_PROMPT


def _needs_fitted_tokenizer(variant, plugins) -> bool:
    """Whether a setting can only be checked against the vocabulary the tokenizer learns from the data:
    ``model.vocab_size`` (it must hold that vocabulary) or a chosen sample prompt (it must encode)."""
    from lmlab.assemble import knows_vocabulary

    if knows_vocabulary(plugins["tokenizer"]):
        return False
    return bool(variant.model.vocab_size) or _samples_prompt(variant.train, plugins["objective"])


def check_sample_prompt(train, objective, tokenizer) -> None:
    """A prompt the user chose for the closing sample must encode: found out now, not after training."""
    if not _samples_prompt(train, objective):
        return
    try:
        ids = tokenizer.encode(train.sample_prompt)
    except (UserError, ValueError, KeyError) as exc:
        raise UserError(f"{train.sample_prompt!r} cannot be encoded by the run's tokenizer "
                        f"({str(exc).split(': ', 1)[-1]}); change the prompt, or set train.sample_tokens = 0",
                        key="train.sample_prompt") from None
    if len(ids) == 0:
        raise UserError("encodes to no tokens, and a sample needs at least one to continue from",
                        key="train.sample_prompt")


def _check_objective_runs_model(plugins, model) -> None:
    """An objective that runs the model itself (Objective.forward_loss) gets the whole model, so no
    pipeline stages, and no extra heads (their loss is the core's default step)."""
    objective = plugins["objective"]
    if not objective.runs_model():
        return
    if plugins["parallel"].runs_forward_backward:
        raise UserError(f"objective {objective.name!r} runs the whole model itself (pairs, heads or rollouts), "
                        f"which parallel plugin {plugins['parallel'].name!r} splits into pipeline stages; use "
                        "another parallel plugin", key="parallel.use")
    if model is not None and getattr(model, "extra_heads", ()):
        raise UserError(f"the model's extra heads ({', '.join(model.extra_heads)}) are trained by the objectives "
                        f"that score logits; objective {objective.name!r} runs the model itself",
                        key="architecture.use")


def run_all(variants, machine: bool = True) -> dict:
    """Run every variant's checks; returns variant name → the context its plugins saw (a run reuses
    them rather than checking again). A refusal in a sweep names the variant as well as the key.
    ``machine``: judge against this machine too (not when the variants run elsewhere: a cluster's
    job checks them again where it runs)."""
    contexts = {}
    for variant in variants:
        try:
            contexts[variant.name] = run(variant, machine=machine)
        except UserError as exc:
            if len(variants) == 1:
                raise
            raise UserError(f"{exc.message} (variant {variant.name})", key=exc.key) from None
    return contexts



def _check_order(variant, order, objective) -> None:
    """A data order that scores by the objective's difficulty needs an objective that gives one; one
    that replays needs an lmlab run as [init] and a causal objective."""
    from lmlab.api import Objective
    from lmlab.train import replay

    if order is not None and order.uses_difficulty and type(objective).difficulty is Objective.difficulty:
        raise UserError(f"objective {objective.name!r} gives no difficulty score (Objective.difficulty); order "
                        f"{order.name!r} needs one: use length or rarity", key="order.use")
    replay.check(variant, order, objective)
