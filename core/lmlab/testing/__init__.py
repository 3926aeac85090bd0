"""lmlab.testing — the conformance kit: one call checks a plugin against its slot's contract.

Like scikit-learn's ``check_estimator``, for attention, position, ffn, optimizer, tokenizer, filter,
data, tracker, decoding, objective and compress plugins (parallel and peft below)::

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

Optimizer, tokenizer, filter, data, tracker, decoding, objective, compress, architecture and executor plugins
(each check's docstring says exactly how; one plugin takes about a second, a tracker that starts helper
processes a few):

====================  ==============================================================================
slot, check           what it requires
====================  ==============================================================================
optimizer             built as the core builds it: ``build(model.param_infos())`` of the core's model
  param_groups        every trainable parameter exactly once; a positive ``lr`` per group; decay-False
                      parameters in groups with ``weight_decay`` 0
  lr_zero             a step at the schedule's lr 0 (``LambdaLR`` writing ``group["lr"]``) moves nothing
  lr_proportional     a step at a quarter of the lr moves a quarter as far
  closure             ``step(closure=...)`` calls it once, with grad enabled, returns its loss, uses its
                      gradients
  no_decay            on zero gradients, groups with weight_decay 0 stay bit-identical, others shrink
  state_dict          saved, ``torch.load(weights_only=True)``, loaded into a fresh build: identical steps
tokenizer             fitted as ``lmlab prepare`` fits it, on :data:`tokenizer.CORPUS` or ``corpus``
  round_trip          ``decode(encode(text)) == text`` on text of the corpus's characters
  vocabulary          ids inside ``vocab_size`` (a plain int), never ``pad_id``; every id decodes
  special_ids         eos/pad/unk/bos/mask: plain ints in range, ``special_id`` agrees, pad and mask apart
  save_load           a fresh instance ``load``-ing what ``save`` wrote: same ids, specials, fingerprint
  fit_determinism     two fits on one corpus agree; fingerprint a str, the same for fresh instances
filter                on :data:`filter.DOCUMENTS` or ``documents``
  outputs             ``apply`` gives None/str/Record; a corpus-level ``signature`` pickles
  per_document        results independent of instance, order and earlier documents
  worker_process      class and options pickled as prepare sends them; same results in a fresh
                      interpreter with another PYTHONHASHSEED
  state_dict          corpus-level: prepare's checkpoint of ``admit``'s state resumes identically
  weights             ``weigh`` (API 1.11): a number in [0, 1] per kept document, the same from a fresh instance
data                  with ``options`` naming some data (a file the test writes)
  documents           str or Record, as ``yields_records`` declares; at least one
  determinism         two passes and a fresh instance yield the same documents
  stats               str → int, JSON, the same after a second pass
  fingerprint         a non-empty str, the same for fresh instances and after reading
tracker               a new and a resumed run in a sandboxed fresh interpreter (:mod:`lmlab.testing.tracker`)
  lifecycle           start / log / finish never raise
  closing_note        a str or None
  run_dir_only        nothing written outside ``RunInfo.run_dir`` (HOME, XDG, TMPDIR, cwd, any path)
  no_secrets          markers put in ``WANDB_API_KEY``, ``HF_TOKEN``... appear in no file and no note
  offline             no connection to or lookup of a host beyond the loopback
decoding              on the kit's reference model, its logits sharpened (:mod:`lmlab.testing.decoding`)
  max_new_tokens      exactly T + n tokens for n = 0, 1 and past the context; the prompt kept as prefix
  greedy_equivalence  at greedy options (``top_k``/beams 1, or ``greedy=``): each token the argmax of an
                      uncached forward over its prefix
  batch_independence  a prompt decoded in a batch = decoded alone
  per_row_options     a TokenDecoder's choose: each row with its own options and generator (as serve)
  eos                 a row stops at its first EOS (then only EOS); generation ends when all rows have
  determinism         same generator seed → same tokens, whatever the global seed
  global_rng          with a generator, torch's global random state is left unchanged
objective             on the core's samplers over a corpus whose targets identify their positions
  declarations        ``causal``, ``special_tokens``, ``sampling`` well-formed; documents → make_batch_from
  batch               int64 (B, T) inputs and targets, ids in range, targets in range or -100
  special_tokens      every id a tokenizer id or a special id from ``setup``, under two vocabularies
  causal              a causal objective never targets a token its inputs show
  padding             padded positions change neither targets nor unpadded inputs
  prompt_mask         prompt-masked objectives score exactly the ``loss_mask`` tokens
  token_labels        None, a (B, L) integer labelling that fits in uint8, or a UserError
  loss                ``compute_loss`` = a float64 cross-entropy by hand (``cross_entropy=False`` skips)
  ignore_index        zero gradient exactly where the target is -100
  determinism         same windows → same batch under other global seeds; global RNG untouched
  difficulty          (API 1.10) one finite score per document, from the document alone, deterministic
  replica_slices      rows given as their own Windows (``first_row``) = those rows of the full batch
  heads               (API 1.10) ``heads`` are modules saved under ``heads.<name>.``, reset reproducibly
  runs                (API 1.10) the runs of ``needs_runs`` stay frozen, in eval mode, unchanged, and matter
  reports             (API 1.10) reported figures: lowercase names, finite detached sums, counts ≥ 1
architecture          the plugin's models of the families it declares that the kit builds (decoder: trained
                      with next-token cross-entropy; encoder), from the reference plugins
                      (:mod:`lmlab.testing.architecture`)
  families            a non-empty tuple of ``FAMILIES``; ``family`` picks each for an objective training it
  language_model      ``vocab_size``/``block_size``; (B, T) → (B, T, V) logits, ``hidden`` (B, T, C);
                      ``new_cache`` for a decoder, ValueError for an encoder
  block_contract      ``model.blocks``; each block's ``attn``, ``ffn`` (the modules the plugins built) and
                      ``checkpointing``
  causality           decoder: later tokens never change earlier logits; encoder: they do
  incremental_decoding  cached prefill/steps/chunks = full forward (1e-5)
  checkpointing       every ``CHECKPOINTING`` policy: loss and gradients = "none"'s (1e-6); "full" keeps
                      fewer activations
  param_infos         every trainable parameter exactly once; ``num_params`` counts each once
  aux_loss            ``model.aux_loss()`` sums the ``aux_loss`` every ffn module set
compress              on a tiny core model, d_model 128 (``model=``: a callable giving another)
  reload              the record plain JSON; saved, ``weights_only``-loaded, restructured: same logits
  bad_options         unknown keys and wrong types refused; int options at their range's ends refused
                      by ``check_model`` (UserError naming the option, model untouched) or compressed
  size                ``bits_per_weight``, ``linear_bytes_ratio``, ``params``... = the saved tensors'
executor              a sweep of two tiny variants through the executor, and here (:mod:`lmlab.testing.executor`)
  runs_every_job      an outcome per job, exit status 0, where it ran; every variant's run completed
  same_numbers        each variant's val_loss, train_loss, steps and params = the same command's run here
  reports             ``report`` names only the sweep's jobs, with fields the core records, as JSON
====================  ==============================================================================

Each of these slots also runs ``plugin_class`` first. Settings they accept besides ``seed`` and
``skip``: ``corpus`` (tokenizer: documents to fit on; objective: ``"segments"``, prompt then response,
or ``"preferences"``, prompt, chosen and rejected answers), ``runs`` (objective: option of
``needs_runs`` → the objective the kit's frozen run of it was trained with, e.g.
``{"reward_run": "reward-model"}``), ``documents`` (filter: str or Record), ``env``
(tracker: environment variables for the tracked run); a data source takes its options::

    def test_my_source_conforms(tmp_path):
        (tmp_path / "a.txt").write_text("one document")
        check_data(MySource, {"path": str(tmp_path / "a.txt")})

Pass the options that matter. Sequence checks run at ``block_size`` (16 by default), and again at a
block_size past any int option of at least half that (2 × its value + 3, at most 1024), with single
cached steps where each int option's value (and twice it) falls: a sliding window, a chunk or a block
size of the plugin is exercised at the options given, not only the class defaults. Then each int
option is set to the top of its range and checked past that: the maximum its Options field declares
(``le``/``lt``, at most 510), or the range a test states with ``ranges={"window": (2, 300)}`` (not
capped). An int option with neither is only exercised at the values tests pass:
``check_attention(MyAttention, {"window": 5})``.

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

What the core hands a plugin about the run it is part of (``CheckContext.run``, ``RunControl.run``,
``Peft.apply``'s ``run``) is a :class:`lmlab.api.RunSettings`; :func:`stand_in_run` makes one for a
plugin's own tests: ``stand_in_run(train={"log_every": 5}, parallel="single")``.
"""

from collections.abc import Iterable

from lmlab.testing import (architecture, attention, compress, data, decoding, executor, ffn, filter, objective,
                           optimizer, position, tokenizer, tracker)
from lmlab.testing.common import DEFAULT_SHAPE, Check, ConformanceError, Subject, run_checks
from lmlab.testing.decoding import check_decoding
from lmlab.testing.generic import verify_class
from lmlab.testing.memory import check_plan_matches_measured
from lmlab.testing.objective import check_objective
from lmlab.testing.parallel import check_parallel_matches_single
from lmlab.testing.peft import check_peft, tiny_model
from lmlab.testing.reference import ReferenceAttention, ReferenceFFN, ReferencePosition, reference_model
from lmlab.testing.stand_in import stand_in_run

#: slot → (the Subject class that builds its modules, name → check function)
SLOTS = {
    "attention": (attention.AttentionSubject, attention.CHECKS),
    "position": (position.PositionSubject, position.CHECKS),
    "ffn": (ffn.FFNSubject, ffn.CHECKS),
    "optimizer": (optimizer.OptimizerSubject, optimizer.CHECKS),
    "tokenizer": (tokenizer.TokenizerSubject, tokenizer.CHECKS),
    "filter": (filter.FilterSubject, filter.CHECKS),
    "data": (data.DataSubject, data.CHECKS),
    "tracker": (tracker.TrackerSubject, tracker.CHECKS),
    "decoding": (decoding.DecodingSubject, decoding.CHECKS),
    "objective": (objective.ObjectiveSubject, objective.CHECKS),
    "compress": (compress.CompressSubject, compress.CHECKS),
    "architecture": (architecture.ArchitectureSubject, architecture.CHECKS),
    "executor": (executor.ExecutorSubject, executor.CHECKS),
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


def check_optimizer(plugin, options=None, **settings) -> None:
    """Run every optimizer check on ``plugin``; raise one ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="optimizer", **settings))


def check_tokenizer(plugin, options=None, **settings) -> None:
    """Run every tokenizer check on ``plugin`` (fitted on ``corpus``, a list of documents, when given);
    raise one ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="tokenizer", **settings))


def check_filter(plugin, options=None, **settings) -> None:
    """Run every filter check on ``plugin`` (on ``documents``, str or Record, when given); raise one
    ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="filter", **settings))


def check_data(plugin, options=None, **settings) -> None:
    """Run every data-source check on ``plugin`` with ``options`` (as a manifest's [data] table gives
    them: a path to a small file); raise one ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="data", **settings))


def check_tracker(plugin, options=None, **settings) -> None:
    """Run every tracker check on ``plugin`` (with ``env``, extra environment variables, when given);
    raise one ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="tracker", **settings))


def check_compress(plugin, options=None, **settings) -> None:
    """Run every compress check on ``plugin`` (on ``model()``, a fresh model, when given); raise one
    ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="compress", **settings))


def check_architecture(plugin, options=None, **settings) -> None:
    """Run every architecture check on ``plugin``: its models, built from the kit's reference position,
    attention and ffn for each family it declares that the kit builds; raise one ConformanceError listing
    the failures."""
    run_checks(iter_checks(plugin, options, slot="architecture", **settings))


def check_executor(plugin, options=None, **settings) -> None:
    """Run every executor check on ``plugin``: a two-variant sweep through it against the same sweep run
    here (``root``: a folder its workers share, when they run elsewhere; ``parallel``: ``--jobs``);
    raise one ConformanceError listing the failures."""
    run_checks(iter_checks(plugin, options, slot="executor", **settings))


def check_plugin(plugin, options=None, **settings) -> None:
    """Run every check of the plugin's own slot (any slot in :data:`SLOTS`)."""
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
    "check_architecture", "check_attention", "check_compress", "check_data", "check_decoding", "check_executor",
    "check_ffn", "check_filter", "check_names", "check_optimizer",
    "check_parallel_matches_single", "check_plan_matches_measured", "check_plugin",
    "check_objective", "check_plugin_class", "check_position", "check_tokenizer", "check_tracker",
    "check_peft", "iter_checks", "reference_model", "stand_in_run", "tiny_model",
]
