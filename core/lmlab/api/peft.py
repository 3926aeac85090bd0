"""The peft slot: parameter-efficient fine-tuning (API 1.4).

A peft plugin changes the assembled model once, when the run is built: it inserts adapter weights,
freezes every other parameter, and says which state-dict entries make up the adapter. The core then
gives the optimizer only the parameters that still require gradients, writes the model's weights as
they were before the adapter went in once per run (``checkpoints/base.safetensors``), keeps only
the adapter (and the optimizer state) in ``last.ckpt``/``best.ckpt``, writes the adapter on its own
to ``checkpoints/adapter.safetensors``, and folds it into the base weights on ``lmlab merge``.

Plugins name the layers they adapt by *role*, not by parameter name, so that one manifest works
across attention and ffn plugins: an attention module says which of its submodules computes the
queries (``q``), keys (``k``), values (``v``) and output (``o``); a feed-forward module its ``up``,
``down`` and ``gate`` projections
([AttentionModule.peft_roles][lmlab.api.attention.AttentionModule.peft_roles],
[FFNModule.peft_roles][lmlab.api.ffn.FFNModule.peft_roles]).
[module_roles][lmlab.api.peft.module_roles] and [resolve_roles][lmlab.api.peft.resolve_roles] turn
roles into full module names of the model.
"""

from typing import TYPE_CHECKING, Any, ClassVar

from lmlab.api.errors import UserError
from lmlab.api.plugin import Plugin

if TYPE_CHECKING:
    import torch
    from torch import nn

    from lmlab.api.run import RunSettings


class Peft(Plugin):
    """One PEFT method. The defaults describe "no adapter": the whole model trains as without a
    ``[peft]`` table, and the core changes nothing about the run."""

    slot = "peft"
    api = ">=1.4,<2"

    parallel: ClassVar[tuple[str, ...] | None] = None
    """The ``parallel.use`` plugins this method works under; a run that combines it with another is
    refused before it starts (``lmlab check`` too), with a UserError naming ``peft.use``. None: any."""

    def apply(self, model: "nn.Module", run: "RunSettings") -> None:
        """Insert the adapter into ``model`` in place and freeze every parameter that is not part of
        it (``requires_grad = False``).

        Called once per process when a run is built: after the model is assembled, initialised and
        given its starting weights, before ``lmlab_model_built`` hooks, the optimizer and any
        checkpoint is restored; also by ``lmlab generate``, ``eval`` and ``merge`` on a trained
        run's base weights before they load its adapter. The model is on the CPU, in training mode,
        with gradients enabled. Must be deterministic given the global random state (a resumed run
        calls it again and then loads the adapter saved in its checkpoint). The default does
        nothing.

        Args:
            model: The assembled language model (``blocks``, each with ``attn`` and ``ffn``: see
                [module_roles][lmlab.api.peft.module_roles]).
            run: The variant, typed (``run.train.max_steps``, ``run.options("parallel")``). Before
                API 1.20 this was the nested manifest, which ``run["train"]["max_steps"]`` still reads
                until 2.0.

        Raises:
            UserError: A target this model does not have, naming the option.
        """

    def is_adapter_key(self, key: str) -> bool:
        """Whether ``key``, an entry of ``model.state_dict()`` after [apply][lmlab.api.peft.Peft.apply],
        belongs to the adapter: what checkpoints and ``adapter.safetensors`` hold.

        Called on every entry of the state dict after [apply][lmlab.api.peft.Peft.apply] and at
        every checkpoint. Every parameter that requires gradients must be one (the core checks);
        entries that are not come from the base weights. A method whose adapter has no entries
        (the default) runs as full training.

        Args:
            key: A full name in ``model.state_dict()`` (no ``model.`` prefix).
        """
        return False

    def merge(self, model: "nn.Module") -> None:
        """Fold the adapter into the base weights, in place, leaving a model whose state dict has
        exactly the keys of the plain model (no adapter entries, no wrapped names) and whose
        outputs are those of the adapted model (``lmlab merge`` checks the logits on a probe batch to
        1e-4). Called by ``lmlab merge``, under ``torch.no_grad()`` with the model in eval mode on the
        CPU, on a model that [apply][lmlab.api.peft.Peft.apply] adapted and that holds a trained
        adapter. The default refuses: a method whose adapter is not a change of weights (a nonlinear
        bottleneck adapter) cannot be merged."""
        raise UserError(f"peft plugin {self.name!r} cannot fold its adapter into the base weights; "
                        "use the unmerged run (lmlab generate works on it)", key="peft.use")

    def adapter_export(self, model: "nn.Module") -> "tuple[dict[str, Any], dict[str, torch.Tensor]]":
        """The adapter as Hugging Face's peft library saves it (API 1.21), for ``lmlab export --format
        peft``: the ``adapter_config.json`` of the method (``peft_type``, rank, scaling, ...) and the
        adapter's weights, each named by the adapted module's name in ``model`` followed by peft's own
        suffix (``blocks.0.attn.q_proj.lora_A.weight``). The core renames the modules to those of the
        exported Hugging Face checkpoint and sets ``target_modules`` and ``base_model_name_or_path``.

        Called by ``lmlab export`` on a model that [apply][lmlab.api.peft.Peft.apply] adapted and that
        holds a trained adapter, in eval mode on the CPU. Default: NotImplementedError, an adapter peft
        cannot load (the export is refused naming the plugin)."""
        raise NotImplementedError

    def regularization(self, model: "nn.Module") -> "torch.Tensor | None":
        """A term added to the training loss at every micro-batch (AdaLoRA's orthogonality penalty),
        logged with the auxiliary losses.

        Called only when a plugin overrides it: in every process, in each training step right after
        the model's forward pass (training mode, gradients on), not in evaluation, and not under a
        parallel plugin that runs the passes itself
        ([Parallel.runs_forward_backward][lmlab.api.parallel.Parallel.runs_forward_backward]).

        Returns:
            A 0-dim tensor on the model's device, with gradients flowing to the adapter, or None
            (the default) for no term.
        """
        return None

    def extra_state(self) -> dict[str, Any]:
        """Training state beyond the adapter weights that a resumed run needs (AdaLoRA's importance
        averages), saved in checkpoints: tensors, numbers, strings and lists or dicts of them (it is
        loaded with ``weights_only=True``). Called at every checkpoint, in every process. Default:
        an empty dict."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what [extra_state][lmlab.api.peft.Peft.extra_state] returned, after
        [apply][lmlab.api.peft.Peft.apply]: when a run resumes from a checkpoint, and when
        ``lmlab generate``, ``eval`` or ``merge`` load a trained run's adapter. Default: nothing."""


def module_roles(model: "nn.Module") -> dict[str, dict[str, list[str]]]:
    """``{"attention": {role: [module names]}, "ffn": {...}}`` for the assembled model: for every
    block ``i``, the roles its attention module declares (``peft_roles()``) under
    ``blocks.<i>.attn.<submodule>`` and those of its ffn module under ``blocks.<i>.ffn.<submodule>``
    (a ``skip`` ffn has none). An encoder–decoder model (API 1.13) adds its encoder's blocks
    (``enc_blocks.<i>...``, listed first) and each decoder block's cross-attention
    (``blocks.<i>.cross.<submodule>``, attention roles like the self-attention's). Names are full
    names in ``model.named_modules()``."""
    found: dict[str, dict[str, list[str]]] = {"attention": {}, "ffn": {}}
    stacks = [("enc_blocks", model.enc_blocks)] if hasattr(model, "enc_blocks") else []
    for prefix, blocks in [*stacks, ("blocks", model.blocks)]:
        for i, block in enumerate(blocks):
            for part, attr in (("attention", "attn"), ("attention", "cross"), ("ffn", "ffn")):
                module = getattr(block, attr, None)
                if module is None or getattr(module, "skip", False) or not hasattr(module, "peft_roles"):
                    continue
                for role, sub in module.peft_roles().items():
                    found[part].setdefault(role, []).append(f"{prefix}.{i}.{attr}.{sub}")
    return found


def resolve_roles(model: "nn.Module", roles: "list[str] | str", key: str = "peft.targets") -> list[str]:
    """Full module names of every module that plays one of ``roles`` (``"all"``: every role the
    model's modules declare), in block order; a UserError naming ``key`` and listing the roles that
    exist when a role matches no module."""
    found = module_roles(model)
    available = {role: names for part in found.values() for role, names in part.items()}
    listing = "; ".join(f"{part}: {', '.join(roles_) if roles_ else '(none)'}" for part, roles_ in found.items())
    if not available:
        raise UserError("this model's attention and ffn modules declare no roles (peft_roles), so no layer can "
                        "be adapted by role", key=key)
    wanted = list(available) if roles == "all" else list(roles)
    if not wanted:
        raise UserError(f"names no role; the roles of this model are {listing}", key=key)
    for role in wanted:
        if role not in available:
            raise UserError(f"role {role!r} matches no module of this model; the roles it has are {listing}",
                            key=key)
    names = {name for role in wanted for name in available[role]}
    return [name for name, _ in model.named_modules() if name in names]
