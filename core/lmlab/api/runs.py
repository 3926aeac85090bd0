"""Other trained runs an objective works with (API 1.10): DPO's frozen reference, PPO's reward model,
a distillation teacher.

An objective names the options that hold run folders in
[Objective.needs_runs][lmlab.api.objective.Objective.needs_runs]. The core reads each folder, refuses
one whose tokenizer gives other ids than the run's own (naming the option), and hands them over
twice: without weights to [Objective.check_runs][lmlab.api.objective.Objective.check_runs] (``lmlab
check``, and ``lmlab run`` before it reads any data), and with their frozen models to
[Objective.prepare][lmlab.api.objective.Objective.prepare] before training.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmlab.api.model import LanguageModel


@dataclass
class TrainedRun:
    """A run folder another run works with (API 1.10)."""

    path: Path
    """The run's folder (a variant's, holding manifest.toml)."""
    manifest: Mapping[str, Any]
    """Its resolved manifest, nested: ``manifest["objective"]["use"]`` is the objective it trained."""
    tokenizer: Any
    """Its fitted [Tokenizer][lmlab.api.tokenizer.Tokenizer] (the same ids as the run's own: the core
    has checked)."""
    model: LanguageModel | None = None
    """Its model with the weights of its best checkpoint (else the last), in eval mode, every parameter
    frozen, moved to the training device (and kept out of the trained model's checkpoints) before
    the first batch; None under ``lmlab check``, which loads no weights. A run trained with an
    objective that adds [heads][lmlab.api.objective.Objective.heads] has them in ``model.heads``."""

    @property
    def objective(self) -> str:
        """The name of the objective the run trained (``"reward-model"``)."""
        return str(self.manifest.get("objective", {}).get("use", ""))


Generate = Callable[..., list[list[int]]]
"""``generate(model, prompts, max_new_tokens, *, stop_ids=(), generator=None)``: see
[ObjectiveContext.generate][lmlab.api.runs.ObjectiveContext.generate]."""


@dataclass
class ObjectiveContext:
    """What [Objective.prepare][lmlab.api.objective.Objective.prepare] receives (API 1.10)."""

    runs: Mapping[str, TrainedRun]
    """Option name of [needs_runs][lmlab.api.objective.Objective.needs_runs] → its run, with its model."""
    tokenizer: Any
    """The run's own fitted [Tokenizer][lmlab.api.tokenizer.Tokenizer]."""
    generate: Generate
    """Continue prompts with the run's ``[decoding]`` plugin (greedy, sample, beam, ...):
    ``generate(model, prompts, max_new_tokens, *, stop_ids=(), generator=None)`` → the new tokens of
    each prompt (a list of lists of ids), each cut after the first id of ``stop_ids`` (which it
    keeps) or at the tokenizer's end-of-text id. ``prompts`` is a list of token-id lists of any
    lengths; ``model`` is the model being trained (as [forward_loss][lmlab.api.objective.Objective.forward_loss]
    receives it) or a run's. The model is put in eval mode for the call and back after it, and
    nothing is recorded for autograd: score the tokens with a forward pass of your own. Draws
    randomness from ``generator`` (a ``torch.Generator`` on the model's device), else the global one."""
    decoder: Any = None
    """The run's ``[decoding]`` plugin, as configured, which ``generate`` uses (its options say, e.g.,
    the sampling temperature the rollouts' probabilities are taken at)."""
    init: Path | None = None
    """The ``[init]`` run folder the trained model started from (None without one, or for Hugging
    Face weights): the default of a reference-run option."""

