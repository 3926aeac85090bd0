"""lmlab.testing — the conformance kit: one call checks a plugin against its slot's contract.

Like scikit-learn's ``check_estimator``, for attention, position and ffn plugins::

    from lmlab.testing import check_attention

    def test_my_attention_conforms():
        check_attention(MyAttention)                     # the plugin class, options at their defaults
        check_attention(MyAttention, {"n_kv_heads": 2})  # or options, as a manifest table would give them

A ``check_*`` call runs every check and raises one :class:`ConformanceError` (an AssertionError)
naming the plugin, each check that failed and what it observed::

    mamba: causality: outputs up to position 7 changed when only inputs after 7 did (no position
    scheme): first at position 3, by 0.12 (output scale 0.5, tolerance 1e-05 of it)

To see each check as its own test, parametrize over :func:`iter_checks` (pytest takes the check's
name as the test id)::

    @pytest.mark.parametrize("check", iter_checks(MyAttention, {"n_kv_heads": 2}))
    def test_conformance(check):
        check()

What is checked (the docstring of each check function says exactly how):

=====================  =========  ========  ===  ============================================
check                  attention  position  ffn
=====================  =========  ========  ===  ============================================
plugin_class           yes        yes       yes  slot base, ``api`` range, Options, hooks
flags                             yes            acting in a place sets its flag
output_fp32/_bf16      yes        yes       yes  shapes, dtypes, finite; bf16 near fp32
causality              yes        yes            inputs after t leave outputs ≤ t unchanged
bidirectional          yes                       declared: with causal False, outputs see every input
position_wise                               yes  tokens do not interact (eval mode)
training_causality                          yes  training: inputs after t leave outputs ≤ t
incremental_decoding   yes        yes            cached prefill/steps/chunks = full forward
cache_reorder          yes                       ``state.reorder`` (beam search)
gradients              yes        yes       yes  every parameter gets a finite, non-zero grad
determinism            yes        yes       yes  same seed → same weights and outputs
state_dict             yes        yes       yes  save / load(weights_only) / load into a fresh build
compile                yes        yes       yes  ``torch.compile`` output and grads = eager
=====================  =========  ========  ===  ============================================

Everything is built against a tiny :data:`DEFAULT_SHAPE` (2 layers, d_model 32, 4 heads,
block_size 16, vocab 37) under fixed seeds, on the CPU, without touching the caller's random state;
one plugin takes a few seconds. Settings every entry point accepts as keywords: ``shape`` (a
``lmlab.api.ModelShape``), ``seed``, ``device``, ``compile_backend`` ("aot_eager" by default, which
traces forward and backward as inductor does without generating code; "inductor" checks code
generation too, at many times the cost) and ``skip`` (names of checks not to run).

Position plugins are checked inside the core's ``LanguageModel`` assembled with the kit's own
reference attention and feed-forward (:mod:`lmlab.testing.reference`), so the kit depends on no plugin.

Parallel plugins: :func:`check_parallel_matches_single` trains a tiny model on one device and with
the plugin on several CPU processes, and requires the same loss at every step and a checkpoint that
``lmlab generate`` loads (:mod:`lmlab.testing.parallel`)::

    def test_my_strategy_matches_one_device(tmp_path):
        check_parallel_matches_single('use = "my-strategy"\ndevices = 2\naccelerator = "cpu"', tmp_path)

It also requires that as many processes took part as the plugin was to start. Its memory layout
(``Parallel.memory_layout``, what ``lmlab plan`` reports) is checked by
:func:`check_plan_matches_measured`: the planned peak per device within 20 % of the peak measured
while a small model trains under the plugin (:mod:`lmlab.testing.memory`).

Peft plugins: :func:`check_peft` applies the plugin to tiny models of installed attention and ffn
plugins (:func:`tiny_model`) and requires that the adapted model starts as the base, that only the
adapter trains, that the adapter round-trips and, for a plugin that merges, that merging is exact
(:mod:`lmlab.testing.peft`)::

    def test_my_adapter_conforms():
        check_peft(MyAdapter, {"r": 4})
"""

from collections.abc import Iterable

from lmlab.testing import attention, ffn, position
from lmlab.testing.common import DEFAULT_SHAPE, Check, ConformanceError, Subject, run_checks
from lmlab.testing.generic import verify_class
from lmlab.testing.memory import check_plan_matches_measured
from lmlab.testing.parallel import check_parallel_matches_single
from lmlab.testing.peft import check_peft, tiny_model
from lmlab.testing.reference import ReferenceAttention, ReferenceFFN, ReferencePosition, reference_model

#: slot → (the Subject class that builds its modules, name → check function)
SLOTS = {
    "attention": (attention.AttentionSubject, attention.CHECKS),
    "position": (position.PositionSubject, position.CHECKS),
    "ffn": (ffn.FFNSubject, ffn.CHECKS),
}


def check_names(slot: str) -> list[str]:
    """The names of the checks of ``slot``, in the order they run."""
    return list(_slot(slot)[1])


def iter_checks(plugin, options=None, *, slot: str | None = None, skip: Iterable[str] = (),
                **settings) -> list[Check]:
    """The checks of ``plugin`` (a plugin class, or an instance carrying its options) as callables.

    ``options`` is a dict (validated by the plugin's Options class) or an Options instance; ``slot``
    defaults to the plugin's own. Each :class:`Check` has a ``name`` (also its ``__name__``, which
    pytest uses as the test id) and raises :class:`ConformanceError` when called, if it fails.
    """
    slot = slot or getattr(plugin, "slot", "")
    subject_type, checks = _slot(slot)
    skip = set(skip)
    unknown = skip - set(checks)
    if unknown:
        raise ValueError(f"no check named {', '.join(sorted(unknown))} for slot {slot!r}; "
                         f"checks: {', '.join(checks)}")
    subject = subject_type(plugin, options, **settings)
    return [Check(name, function, subject) for name, function in checks.items() if name not in skip]


def check_attention(plugin, options=None, **settings) -> None:
    """Run every attention check on ``plugin``; raise one ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="attention", **settings))


def check_position(plugin, options=None, **settings) -> None:
    """Run every position check on ``plugin``; raise one ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="position", **settings))


def check_ffn(plugin, options=None, **settings) -> None:
    """Run every ffn check on ``plugin``; raise one ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="ffn", **settings))


def check_plugin(plugin, options=None, **settings) -> None:
    """Run every check of the plugin's own slot (attention, position or ffn)."""
    run_checks(iter_checks(plugin, options, **settings))


def check_plugin_class(plugin, slot: str | None = None, options=None) -> None:
    """The basics, for a plugin of any slot: it derives from the slot's base in lmlab.api, its ``api``
    range includes ``lmlab.api.API_VERSION``, its Options subclass lmlab.api.Options and accept
    ``options`` (or, when none are given, build with every default), its hooks are valid, and it
    constructs. Raises ConformanceError naming the plugin."""
    subject = Subject(plugin, options)
    subject.slot = slot or getattr(plugin, "slot", "")
    given = options is not None
    run_checks([Check("plugin_class", lambda s: verify_class(s.cls, s.slot, s.options if given else None), subject)])


def _slot(slot: str):
    if slot not in SLOTS:
        raise ValueError(f"lmlab.testing checks the slots {', '.join(SLOTS)}; got {slot!r}")
    return SLOTS[slot]


__all__ = [
    "DEFAULT_SHAPE", "Check", "ConformanceError", "ReferenceAttention", "ReferenceFFN", "ReferencePosition",
    "check_attention", "check_ffn", "check_names", "check_parallel_matches_single", "check_plan_matches_measured",
    "check_plugin",
    "check_plugin_class", "check_position",
    "check_peft", "iter_checks", "reference_model", "tiny_model",
]
