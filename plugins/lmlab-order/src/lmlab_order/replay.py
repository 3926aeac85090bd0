"""Replay: a share of the fine-tuning rows taken from the pretraining corpus, against forgetting.

Fine-tuning on a narrow task wears away what pretraining taught (catastrophic forgetting, McCloskey &
Cohen 1989); mixing a little of the pretraining data back into the fine-tuning batches is the
simplest remedy, and it is standard practice for continued pretraining and instruction tuning
(e.g. Ouyang et al. 2022, "PPO-ptx"; Ibrahim et al. 2024 replay 1–5 %). ``[order] use = "replay"``
with ``share = 0.05`` replaces each training row, with probability 0.05, by a random window of the
``[init]`` run's own training split (its prepared tokens, through the same cache; the tokenizer is the
init's, so the ids agree). The fine-tuning rows themselves are drawn uniformly.
"""

from lmlab.api import Field, Order, OrderOptions


class ReplayOptions(OrderOptions):
    share: float = Field(0.05, gt=0, lt=1, help="share of training rows taken instead from the [init] run's own "
                                                "training corpus")


class Replay(Order):
    """A share of every batch from the [init] run's training corpus; the rest drawn uniformly."""

    api = ">=1.19,<2"  # Order.replays, replay_share
    Options = ReplayOptions
    replays = True

    def replay_share(self, step: int) -> float:
        return self.options.share
