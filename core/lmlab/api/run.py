"""The run a plugin is part of, typed (API 1.20): the core's own tables (``[model]``, ``[train]``,
``[init]``, ``[resolved]``) as their Options classes, and :class:`RunSettings`, the resolved variant
that plugins read instead of the nested manifest.

Every default is filled in and every derived number is the one the run uses (``train.min_lr``,
``train.eval_batch_size``, ``resolved.grad_clip``), computed once when the manifest is resolved.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, model_validator

from lmlab.api.architecture import refuse_moved_early_exit
from lmlab.api.errors import UserError
from lmlab.api.options import Field, Options, refuse_moved

#: What activation checkpointing recomputes in backward (``LanguageModel.set_checkpointing``).
CHECKPOINTING = ("none", "full", "ffn", "attention")


#: ``[model]`` keys that the architecture slot took over (API 1.18): the family and the encoder-decoder's own.
MOVED_TO_ARCHITECTURE = ("architecture", "encoder_layers", "share_embeddings", "decoder_start_id")

class ModelOptions(Options):
    """``[model]``: the shape every architecture, attention and ffn plugin is built to."""

    # An upper bound far above any model trained (hundreds of layers), so a typo fails at once
    # instead of building billions of modules.
    n_layers: int = Field(4, gt=0, le=10_000, help="number of transformer blocks")
    d_model: int = Field(128, gt=0, help="width of the residual stream")
    n_heads: int = Field(4, gt=0, help="attention heads (query heads for grouped-query attention)")
    head_dim: int | None = Field(None, gt=0, help="size of one attention head; default: d_model / n_heads "
                                                  "(Qwen3 and Gemma set it otherwise)")
    block_size: int = Field(64, gt=0, help="training context length in tokens")
    vocab_size: int | None = Field(None, gt=0, help="default: the tokenizer's; larger pads the embedding")
    dropout: float = Field(0.0, ge=0, lt=1, help="residual, embedding and attention dropout")
    bias: bool = Field(False, help="biases in linear layers and LayerNorm")
    norm: Literal["layernorm", "rmsnorm"] = Field("layernorm", help="normalisation layer")
    norm_eps: float = Field(1e-5, gt=0, help="epsilon of the normalisation layers")
    tie_embeddings: bool = Field(True, help="share the token embedding with the output head")
    init_std: float = Field(0.02, gt=0, help="std of the normal weight init (GPT-2)")

    @model_validator(mode="before")
    @classmethod
    def _moved_to_architecture(cls, values):
        # API 1.18 moved the model family and the encoder-decoder's settings into the architecture slot.
        example = '(e.g. [architecture] use = "encoder-decoder" with its encoder_layers, share_embeddings, decoder_start_id)'
        refuse_moved("model", values, "the architecture slot", {
            key: ("[architecture] use" if key == "architecture" else f"architecture.{key}") + f" {example}"
            for key in MOVED_TO_ARCHITECTURE})
        refuse_moved_early_exit("model", values)
        return values

    @model_validator(mode="after")
    def _heads_divide_width(self):
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self


class TrainOptions(Options):
    """``[train]``: the training loop (steps, batches, precision, schedule, evaluation, checkpoints)."""

    max_steps: int = Field(1000, gt=0, help="optimizer steps")
    batch_size: int = Field(12, gt=0, help="sequences per micro-batch (per device)")
    grad_accum: int = Field(1, gt=0, help="micro-batches per optimizer step")
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true"] = Field(
        "32-true", help="Lightning precision: *-mixed autocasts the forward pass and keeps float32 weights; "
                        "16-mixed (GPUs only) scales the loss so float16 gradients do not underflow")
    loss_scale_init: float = Field(2.0**16, gt=0, help="16-mixed: the loss scale to start from")
    loss_scale_growth_interval: int = Field(
        2000, gt=0, help="16-mixed: double the loss scale after this many steps without inf/NaN gradients")
    loss_scale_backoff: float = Field(
        0.5, gt=0, lt=1, help="16-mixed: multiply the loss scale by this when gradients overflow (the step is skipped)")
    grad_clip: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        1.0, help="clip the global gradient norm to this (0: off); auto = 0.1·sqrt(model.n_layers)")
    lr_scaling: Literal["none", "sqrt", "linear"] = Field(
        "none", help="scale optimizer.lr, given for base_batch_tokens, to this run's global batch: "
                     "lr·sqrt(batch/base) (Adam-family), lr·batch/base (SGD), or not at all")
    base_batch_tokens: int | None = Field(
        None, gt=0, help="the global batch in tokens that optimizer.lr was chosen for (lr_scaling needs it)")
    warmup_steps: int = Field(100, ge=0, help="linear learning-rate warmup")
    lr_schedule: Literal["cosine", "linear", "constant", "wsd", "inverse-sqrt"] = Field(
        "cosine", help="after warmup: cosine, linear or no decay to min_lr at decay_steps; wsd holds the peak "
                       "then decays linearly over the last decay_fraction; inverse-sqrt decays as "
                       "sqrt(warmup/step), floored at min_lr")
    decay_fraction: float = Field(0.2, gt=0, le=1, help="wsd: the share of decay_steps spent decaying")
    decay_steps: int | None = Field(None, gt=0, help="step at which decay ends (default: max_steps)")
    min_lr: float | None = Field(None, ge=0, help="learning rate at the end of decay (default: lr / 10)")
    eval_every: int = Field(250, gt=0, help="evaluate every this many steps (and at the end)")
    eval_steps: int = Field(20, gt=0, help="batches per periodic evaluation; the final one covers the whole split")
    eval_batch_size: int | None = Field(None, gt=0, help="sequences per eval batch (default: 4 × batch_size)")
    checkpoint_every: int = Field(250, gt=0, help="write checkpoints/last.ckpt every this many steps")
    log_every: int = Field(10, gt=0, help="write a metrics.jsonl line every this many steps")
    compile: bool = Field(False, help="torch.compile the model (compile time is reported apart, as compile_s)")
    checkpointing: Literal[CHECKPOINTING] = Field(
        "none", help="activation checkpointing: recompute this part of each block in backward to save memory")
    threads: int | None = Field(None, gt=0, help="torch intra-op threads (default: torch's choice)")
    sample_tokens: int = Field(200, ge=0, help="tokens of text to generate at the end (0: none)")
    sample_prompt: str = Field("\n", help="prompt for that sample")

    @model_validator(mode="before")
    @classmethod
    def _moved_early_exit(cls, values):
        refuse_moved_early_exit("train", values)
        return values

    @model_validator(mode="after")
    def _warmup_fits(self):
        # decay_steps = max_steps is what the default stands for (a run shorter than its warmup
        # records it so), not a choice to refuse.
        if self.decay_steps is not None and self.decay_steps < self.warmup_steps and self.decay_steps != self.max_steps:
            raise ValueError("decay_steps must not be smaller than warmup_steps")
        if self.lr_scaling != "none" and self.base_batch_tokens is None:
            raise UserError(f"required by lr_scaling = \"{self.lr_scaling}\": the global batch (tokens per "
                            "optimizer step) that optimizer.lr was chosen for", key="train.base_batch_tokens")
        return self


class ResolvedOptions(Options):
    """The numbers a run derives from the rules in [train] (``grad_clip = "auto"``, ``lr_scaling``),
    written by lmlab into manifest.toml's ``[resolved]``. Given back (a rerun), each must equal what
    the rules give, so a run folder never says one thing and trains another."""

    batch_tokens: int = Field(..., gt=0, help="tokens per optimizer step over every data-parallel replica")
    lr_factor: float = Field(..., gt=0, help="what lr_scaling multiplies each param group's learning rate by")
    lr: float | None = Field(None, gt=0, help="optimizer.lr × lr_factor: the peak learning rate trained with")
    grad_clip: float = Field(..., ge=0, help="the gradient-norm clip trained with (0: off)")


class InitOptions(Options):
    """Start from trained weights: an lmlab run folder, one of its checkpoints, or a local Hugging Face
    Llama-family folder; the model's shape and tokenizer are the init's (see ``lmlab.pretrained``)."""

    # `from` is a Python keyword: the field is from_, the manifest key (and what is written back) `from`.
    model_config = ConfigDict(serialize_by_alias=True)

    from_: Path = Field(..., alias="from", help="a run folder (holds manifest.toml), a checkpoint file in one, "
                                                "or a Hugging Face folder (config.json, *.safetensors, "
                                                "tokenizer.json); relative to the manifest")
    checkpoint: Literal["best", "last"] = Field(
        "best", help="a run folder's checkpoints/best.ckpt (by val loss; last.ckpt when there is none) or "
                     "last.ckpt; ignored for a checkpoint file or a Hugging Face folder")
    strict: bool = Field(True, help="every weight of the model must come from the init (false: weights the init "
                                    "lacks keep their fresh initialisation, and extra ones are ignored)")



class EvalOptions(Options):
    """``[eval]``: lm-evaluation-harness tasks scored at the end of each variant's run (API 1.21), as
    ``lmlab eval RUN --tasks`` scores them (needs ``lmlab[eval]``)."""

    tasks: list[str] = Field([], help="task names (lmlab ships shakespeare_next_line, shakespeare_ppl, "
                                      "shakespeare_instructions); empty: none")
    limit: int | None = Field(None, gt=0, help="score only the first N documents of each task")
    num_fewshot: int | None = Field(None, ge=0, help="examples put before each question (unset: the task's)")
    batch_size: int = Field(8, gt=0, help="requests per forward pass")


class RunSettings:
    """One resolved variant of a manifest, as plugins see it (API 1.20): ``CheckContext.run``,
    ``RunControl.run``, the ``run`` given to ``Peft.apply`` and to the ``lmlab_model_built`` hook.

    The core implements it (a plugin only reads it); it is frozen. Read ``run.train.max_steps``,
    ``run.model.d_model``, ``run.uses("parallel")``, ``run.options("parallel").devices``.
    """

    experiment: str
    """The manifest's name, shared by every variant of a sweep."""
    name: str
    """The variant's name (``attention.use=gqa,seed=1``; ``default`` without a sweep)."""
    seed: int
    model: ModelOptions
    """``[model]``, the shared shape, as the manifest gave it (the vocabulary the tokenizer decides is
    the model's ``ModelShape``, not this)."""
    train: TrainOptions
    """``[train]``, with ``min_lr``, ``decay_steps`` and ``eval_batch_size`` filled in."""
    resolved: ResolvedOptions | None
    """What the rules of ``[train]`` derive (``grad_clip = "auto"``, ``lr_scaling``): as
    ``manifest.toml``'s ``[resolved]`` records it."""
    init: InitOptions | None
    """A fine-tune's ``[init]``, or None."""
    eval: EvalOptions | None
    """``[eval]``, the tasks scored at the end of the run (API 1.21), or None."""

    def uses(self, slot: str) -> str | tuple[str, ...] | None:
        """The plugin the variant names for ``slot`` (a tuple of names for a many-valued slot), or None
        when the variant has none there."""
        raise NotImplementedError

    def options(self, slot: str, plugin: str | None = None) -> Options:
        """The validated options of the slot's plugin (``plugin``: which one, in a many-valued slot)."""
        raise NotImplementedError

    @property
    def grad_clip(self) -> float:
        """The gradient-norm clip trained with (``train.grad_clip = "auto"`` resolved; 0: off)."""
        raise NotImplementedError

    @property
    def manifest(self) -> Mapping[str, Any]:
        """The same run as nested JSON values, as ``manifest.toml`` records it: what a tracker logs."""
        raise NotImplementedError

    # Plugins written for API < 1.20 received the nested manifest where they now receive the run
    # (``Peft.apply``): they keep working until 2.0 by indexing it as they did.
    def __getitem__(self, key: str) -> Any:
        """``run.manifest[key]``, for plugins written before API 1.20 (until 2.0)."""
        return self.manifest[key]

    def get(self, key: str, default: Any = None) -> Any:
        """``run.manifest.get(key, default)``, for plugins written before API 1.20 (until 2.0)."""
        return self.manifest.get(key, default)
