"""The version of the plugin API.

Plugins declare the range they work with (``Plugin.api``); discovery refuses a plugin whose range
excludes this version. Bump the minor version when the API gains something (old plugins keep
working), the major version when something a plugin relies on changes. A name is removed only in a
major version, or, for a user-facing manifest spelling, replaced by a one-line refusal that names the
new key (``[model] architecture`` → ``[architecture] use``, ``[data] curriculum`` → ``[order] use``), while
run folders recorded under the old spelling are still read (``lmlab.upgrade``).

The policy for ``api``: declare ``">=1.N,<2"``, where 1.N is the minor (listed below) that introduced
the newest API feature the plugin uses, whether it calls it, imports it, overrides it or sets it: a
plugin that overrides ``check`` or sets ``yields_records`` needs ``>=1.6``, though an older core would
load it and silently ignore the override. ``<2``: the next major version may change what it relies
on. A plugin that uses none of the features below keeps ``Plugin.api``'s default, ``">=1.0,<2"``.
Name the feature that sets the bound in a comment on the line (``api = ">=1.4,<2"  # peft_roles``),
and raise the bound when the plugin starts to use a newer one.

1.1: the ``lmlab_train_batch_end`` hook receives ``log`` (is this a logging step); ``FFNModule.skip``
     leaves a block without its ffn part; ``_no_weight_decay`` on a parameter exempts it from decay.

1.2: ``RunInfo`` carries ``variant`` (the seedless name) and ``environment``; ``Tracker.closing_note``
     lets a tracker say something after a sweep (how to sync offline runs).

1.3: ``Parallel.configure_model(model, device_mesh)`` shards or splits the model under a strategy with
     a device mesh (Lightning's ``ModelParallelStrategy``: FSDP2, tensor/pipeline parallelism);
     ``lmlab.api.parallel.resolve_devices`` checks ``accelerator``/``devices`` against the machine.
     ``Filter``, the base class of the filter slot (per-document ``keep``/``transform`` in worker
     processes, corpus-level ``signature``/``admit``); data sources may yield ``Record`` (``Segment``s
     marked scored or not, for prompt-masked objectives) as well as ``str``, and report ``stats()``;
     ``Tokenizer.fit_documents`` learns from the training documents as a stream.
     ``AttentionModule.tensor_parallel_plan`` / ``FFNModule.tensor_parallel_plan`` (Megatron-style split,
     None = unsupported); ``Parallel.runs_forward_backward`` with ``forward_backward``/``forward_loss``
     (a layout that runs the passes itself: pipeline schedules); ``Parallel.clip_grad_norm`` (global-norm
     clipping for sharded or split models); ``LanguageModel.pipeline_stage(start, stop)``;
     ``Parallel.memory_layout`` (how a layout divides parameters, gradients and optimizer state, for
     ``lmlab plan``).

1.4: Objectives say what they need (``lmlab.api.objective``): ``Objective.causal`` (False: the model is
     built with ``MixerContext.causal = False``, bidirectional attention, which an attention plugin
     supports by declaring ``Attention.bidirectional = True``; others are refused naming ``attention.use``),
     ``Objective.special_tokens`` with ``Objective.setup(Vocabulary)`` (ids from ``Tokenizer.special_id``
     or reserved past the tokenizer's vocabulary, growing the model's), ``Objective.sampling``
     ("windows" or padded "documents"), ``Objective.token_labels(TokenSplit)`` (per-token labels
     sampled with the windows, e.g. the prepared loss mask), and ``Objective.make_batch_from(Windows)``
     (tokens, labels, padding and a random stream seeded by seed and step, sliced per data-parallel
     replica from the global batch).
     ``Tokenizer.pad_id`` (default None); ``Tokenizer.special_id`` defaults to ``eos_id``/``pad_id`` for
     "eos"/"pad" and names "unk", "bos", "mask" as the other roles with a fixed meaning.
     ``Peft``, the base class of the peft slot (``apply`` once at build time, ``is_adapter_key``,
     ``merge``, ``regularization``, ``extra_state``, ``parallel``), with ``AttentionModule.peft_roles`` /
     ``FFNModule.peft_roles`` (role → submodule: q/k/v/o, up/down/gate) and ``module_roles`` /
     ``resolve_roles`` (roles → full module names of the model).
     ``DataOptions.replay``: a share of fine-tuning rows drawn from the ``[init]`` run's training corpus.

1.5: ``Tokenizer.fingerprint`` (default ""): the contents of files a tokenizer reads besides its options,
     hashed into the token-cache key.

1.6: ``Filter.state_dict`` / ``Filter.load_state_dict``: a corpus-level filter's state as NumPy arrays
     and JSON values, which the preparation's checkpoints store without pickling (the default None:
     the filter cannot be checkpointed, and an interrupted preparation filters again from the start).
     ``Plugin.check(context)`` with ``CheckContext`` (shape, the other plugins, the resolved manifest,
     the model on the meta device, whether to check against this machine): refusals before anything
     is built or read, by ``lmlab check`` and at the start of a run. ``DataSource.yields_records``.
     ``LaunchOptions`` (devices, num_nodes, accelerator, backend, with ``processes()`` and
     ``planned_processes()``), shared by the parallel plugins; ``Parallel.device_type`` and
     ``Parallel.trainer_precision`` (the precision, and 16-mixed's loss scaler, are the parallel
     plugin's business; ``loss_scaling`` reads the ``train.loss_scale_*`` options); the default
     ``Parallel.check`` refuses an accelerator the machine lacks and 16-mixed on the CPU.

1.7: The monitor slot's API (``lmlab.api.monitor``): ``Monitor``, ``RunControl`` (skip a step, roll back,
     locate the first non-finite module, fail with a ``Diagnosis``, note a warning), ``RunFailed``,
     ``Diagnosis``/``Fix``, ``StepTiming``. Hooks ``lmlab_run_start(control)`` and
     ``lmlab_run_end(status, control)`` (whose return joins summary.json);
     ``lmlab_before_optimizer_step`` receives ``grad_norm``, ``loss`` and ``control``;
     ``lmlab_train_batch_end`` receives ``timing`` and ``control``. ``LaunchOptions.timeout_s`` (how long a
     collective waits before the run fails).

1.8: Decoding over an engine (``lmlab.api.decoding``): ``Decoder.decode(engine, prompts, outputs, generator)``
     continues prompts of any lengths and yields tokens as they are made, through ``Engine`` (add, step,
     rewind, fork, assign, release, companion) and ``Outputs`` (limits, finished flags, ``ends``,
     ``offer`` for n-best); ``Decoder.generate`` defaults to it; ``Decoder.needs_runs`` with
     ``Decoder.prepare`` (other run folders a decoder loads, e.g. a speculative draft) and
     ``Decoder.rows_per_prompt``. Ragged decoding: ``AttentionModule.kv_layout`` (the core may hold the
     keys and values, in a contiguous or paged cache shared by rows of different lengths),
     ``MixerContext.key_mask`` and per-row ``MixerContext.positions`` (B, T), which a position module
     takes when it declares ``PositionModule.per_row``. ``DataSource.chat_template`` (how a chat turns
     into the prompt a run was trained on, for ``lmlab serve``'s chat completions).

1.9: The compress slot's API (``lmlab.api.compress``): ``Compressor`` (``check_model`` refuses settings a
     model cannot take before anything runs, ``compress`` a trained model in place and return a JSON
     record, ``restructure`` a freshly built one from it so the compressed state dict loads,
     ``calibrated``) and ``Calibration`` (token windows from the run's data or a file: ``batches``,
     ``run``, ``losses``). Structured head pruning: ``AttentionModule.head_groups`` and
     ``AttentionModule.prune_heads``. Early exit: ``DecodingOptions.exit_threshold`` (a decoder that
     picks one token per step may leave at the first exit head whose confidence reaches it; the core
     runs the loop, the plugin needs nothing new).

1.10: Alignment and transfer objectives: ``Objective.forward_loss`` (the objective runs the model itself:
     pairs, hidden states into a head, rollouts), ``Objective.heads`` (modules added to the model as
     ``model.heads``, trained, saved and loaded with it), ``Objective.needs_runs`` with ``check_runs``
     and ``prepare`` (other run folders, a frozen reference, reward model or teacher, as
     ``lmlab.api.runs.TrainedRun``, and ``ObjectiveContext.generate``, rollouts with the run's decoding
     plugin), ``Objective.report`` (per-sample figures into metrics.jsonl and summary.json as
     ``train_<name>``/``val_<name>``), ``Batch.n_scored``. ``LanguageModel.__call__(idx, hidden=True)``
     returns the final hidden states. ``Segment.label`` (the loss mask's value on a scored segment's
     tokens, telling a record's scored parts apart). ``DataOptions.curriculum`` (order training
     documents from easy to hard, by length, token rarity or the objective's ``difficulty``).

1.11: Per-document sample weights: ``Filter.weigh(doc)`` (a number in [0, 1] for a kept document) and a
     float from a corpus-level ``Filter.admit`` (keep with that weight); a document's weight is the
     product of its filters', stored beside the shards, and training draws windows or documents in
     proportion to it.

1.12: ``Filter.report`` (a corpus-level filter's tables about the corpus it filtered, printed by
     ``lmlab prepare`` and kept in ``summary.json``'s ``data_filters``) and ``Table``.

1.13: Encoder–decoder models: ``Attention.cross_attention`` and ``Attention.build_cross`` (a
     ``CrossAttentionModule`` attending from decoder tokens to ``MixerContext.memory``, honouring
     ``MixerContext.memory_padding``; ``memory_kv`` for decoding), ``ModelShape.causal`` (False for an
     encoder stack), ``Objective.architectures`` (which of decoder, encoder, encoder-decoder an objective
     trains), ``Vocabulary.decoder_start_id``, ``Seq2SeqBatch`` (encoder tokens beside the decoder's) and
     ``Batch.model_inputs`` (what the model's forward takes besides ``input_ids``).

1.14: ``Filter.shuffle_keys`` and ``Filter.admit_among``: a corpus-level filter whose verdict depends
     only on earlier admitted documents sharing a key lets a Dask preparation partition its index by
     key over the workers.

1.15: ``Parallel.resolved``: the choices a parallel plugin made for the machine (DeepSpeed's CPU Adam or
     torch's AdamW for an offloaded optimizer), recorded in ``provenance.json``.

1.16: ``Optimizer.update_rule``: the standard update an optimizer plugin's optimizer applies exactly
     (``"adamw"``), so that a parallel plugin may step the same param groups with its own
     implementation of it (DeepSpeed's CPU Adam under ZeRO-Offload) and keeps the plugin's
     optimizer otherwise. ``Parallel.memory_savings``: the settings of a parallel plugin that hold
     less per device, which an out-of-memory diagnosis plans and suggests; ``Fix.also``, further keys
     a fix sets together with its ``key``.
     ``DataSource.parts`` and ``DataSource.documents_in``: a source cut into pieces that a Dask
     preparation's workers read on their own (this process only plans).
     ``RunControl.rollback`` before the first checkpoint keeps the current finite weights and lowers
     the learning rates, instead of failing the run. ``Objective.drops_truncated``: documents longer
     than a row are left out of the loss, which the core counts, warns about, and refuses when none fit.

1.17: Token-level decoding (``lmlab.api.decoding``): ``TokenDecoder.choose(logits, rows)`` picks one
     token per row of a step, vectorised over ``TokenRows`` (each row's options, as ``values`` tensors,
     and its own generator, drawn through ``sample``); ``TokenDecoder.decode`` is the loop ``lmlab
     generate`` runs over it, and ``lmlab serve`` calls ``choose`` inside its continuous batching, a
     request's fields setting the decoder's own options for that request.
     The data-order slot (``lmlab.api.order``): ``Order`` (``scores`` the training documents once,
     ``pool`` says which of them each step draws from; ``competence``), ``OrderOptions`` (``start``,
     ``steps``, ``pacing``) and ``TrainingDocuments`` (with the objective's ``difficulty``).
     ``DataOptions.curriculum`` is the older spelling of ``[order] use``.
     The conformance kit, versioned with this API: ``lmlab.testing.check_compress`` (reload equality,
     bad options refused, size figures in a compress record's ``summary`` that match the saved tensors:
     ``bits_per_weight``, ``linear_bytes_ratio`` over the record's ``modules``, ``params``,
     ``nonzero_params``, ``sparsity``); ``check_objective`` checks ``Objective.difficulty``; the
     length re-check takes each int option to the top of its declared (``le``/``lt``) or stated
     (``ranges=``) range.

1.18: The architecture slot (``lmlab.api.architecture``): ``Architecture`` (``families``, ``family``,
     ``decoder_start_id``, ``build(ModelParts)``) builds the model; ``[model] architecture``,
     ``encoder_layers``, ``share_embeddings`` and ``decoder_start_id`` moved to it (the first-party
     ``encoder-decoder`` plugin). The pieces a wiring is made of: ``Stack`` (the decoder/encoder stack,
     taking ``block=`` and one mixer plugin per layer), ``Block`` (``reset_parameters(shape)``,
     ``new_state``), ``build_norm``, ``CHECKPOINTING``, ``param_infos``, ``num_params``. Composition:
     ``Architecture.components`` declares option fields that hold other plugins' tables, which the core
     validates, records, checks and builds (``ModelParts.components``). Auxiliary losses are gathered
     from every module of a block, not only its ffn.
     ``DataOptions.curriculum`` and its ``curriculum_*`` pacing, the older spelling of ``[order]``, are
     refused naming it (``lmlab.api.data.MOVED_TO_ORDER``).
     A model whose decoding needs more than the shared key/value store supplies its own engine
     (``make_engine(rows, max_len, **settings)``, see ``LanguageModel``), which the core uses instead of
     its own; ``lmlab.api.decoding.SharedCacheEngine`` (the core's engine, to subclass: ``forward_rows``,
     ``free_rows``, ``history``, ``cache``, ``device``, ``model``) and ``engine_supports_rows``.
     Checkpoint readers: ``Architecture.hf_model_types`` (config.json ``model_type`` → family name),
     ``hf_tables``, ``hf_weight_files`` and ``hf_state`` read a Hugging Face folder for ``[init] from``
     (the Llama and T5 readers of ``lmlab.interop`` moved to the ``decoder`` and ``encoder-decoder``
     plugins).
     ``Monitor.nonfinite_recovery``: a monitor's own options that keep a run going through non-finite
     steps, which a non-finite diagnosis suggests adding (the first installed monitor declaring one).
     ``Tracker.run_files``: what a tracker keeps in a run folder, removed with the run's own files when
     the run starts over.

1.19: ``Order.replays`` and ``Order.replay_share(step)``: a data order mixes rows of the ``[init]`` run's
     training split into each batch, drawn by the core (the first-party ``replay`` order);
     ``DataOptions.replay``, its older spelling, is refused naming ``[order] use = "replay"``.
     Model hooks a technique's model class uses instead of the core knowing the technique (early exit
     moved into the ``decoder`` architecture's options): ``Stack.extra_heads``, ``extra_loss_weight``,
     ``extra_losses_name`` and ``extra_logits`` (prediction heads the objective scores beside the output
     head; ``forward(idx, extras=True)``; ``StepLoss.extras``), ``Stack.add_modules`` (a subclass's
     modules, initialised with the rest), ``Stack.init_missing`` (weights an ``[init]`` lacks that the
     model starts itself), ``Plugin.free_options`` (options a run may set otherwise than its ``[init]``),
     a model's ``make_engine`` may return None (the core's engine), and ``Engine.report`` (what
     ``lmlab generate`` prints of how the engine decoded). ``ModelParts.exit_layers`` is removed, and
     ``model.exit_layers``, ``train.exit_loss_weight``, ``train.train_only`` and
     ``DecodingOptions.exit_threshold`` are refused naming the architecture option each became
     (``lmlab.api.architecture.MOVED_EARLY_EXIT``).

1.20: One typed run (``lmlab.api.run``): ``RunSettings``, the resolved variant plugins read instead of the
     nested manifest (``run.train.max_steps``, ``run.model.d_model``, ``run.uses(slot)``,
     ``run.options(slot)``), with the core's tables as Options classes (``ModelOptions``,
     ``TrainOptions``, ``InitOptions``, ``ResolvedOptions``). ``CheckContext.run``, ``RunControl.run``,
     the ``run`` argument of the ``lmlab_model_built`` hook; ``Peft.apply(model, run)`` receives it in
     place of the manifest. Deprecated, removed in 2.0: ``CheckContext.manifest`` and
     ``RunControl.manifest``, and reading the run as a dict (``run["train"]["max_steps"]``), which is
     how a peft plugin written before 1.20 keeps working. ``lmlab.testing.stand_in_run`` makes one for a
     plugin's own tests. ``Parallel.holds_whole_state``: whether every process holds the whole weights
     and optimizer state (False: a rollback is refused), asked instead of the plugin's name.
     ``lmlab.api.options.refuse_moved``: the one-line refusal of a key an API version moved, which the
     core's three moves (to the architecture slot, the order slot, the architecture's options) share
     and a plugin may use for its own renamed options.
     Checkpoints out and other families in: ``Architecture.hf_export(tables, state)`` (config.json and
     the state dict of a Hugging Face checkpoint computing what the model computes, for ``lmlab
     export --format hf``), ``Tokenizer.save_hf(folder)`` (the files transformers' AutoTokenizer
     loads), ``Tokenizer.chat_template()`` (the model's own Jinja chat template, rendered by ``lmlab
     serve`` and ``lmlab generate --messages/--chat``), ``ModelShape.explicit_head_dim`` with
     ``[model] head_dim`` (heads sized apart from the width, Qwen3).

1.21: Conversations: a data source may yield ``Conversation`` (``Message`` turns of system, user and
     assistant), which ``lmlab prepare`` writes out with the tokenizer's chat template, or with the
     source's own (``DataSource.conversation_template``), scoring the assistant's turns. Adapters out:
     ``Peft.adapter_export(model)`` (the adapter as Hugging Face's peft saves it, for ``lmlab export
     --format peft``); ``gguf`` joins the export formats. Evaluation: ``Tracker.amend(run_dir, values)``
     (task scores added to a finished run's record), ``RunSettings.eval`` with ``EvalOptions`` (the
     ``[eval]`` table), ``TokenDecoder.picks_most_likely`` (a greedy decoder: ``lmlab serve`` accepts
     ``temperature: 0`` for it). Decoding: ``TokenRows.history`` (each row's tokens so far, for
     penalties that look back: lmlab-decoding's ``repetition_penalty`` and ``no_repeat_ngram_size``),
     ``Decoder.report()`` (what ``lmlab generate`` prints of how decoding went: a speculative
     decoder's acceptance rate).

1.22: The executor slot (``lmlab.api.executor``), named on the command line (``lmlab run --executor``,
     ``lmlab prepare --executor``), not in a manifest: ``Executor`` (``start``, ``run_variants``,
     ``status``, ``preparation``, ``close``; ``cli_options``), ``VariantJob`` (one variant's ``lmlab run
     --only`` command and its launch shape), ``JobOutcome`` and ``run_job`` (a job's command run where
     it is called, dying with its caller). What a preparation's pool is made of, for an executor that
     prepares data: ``PreparationWorker``, ``PluginSpec``, ``ReadTask`` and ``WorkerLost`` (the Dask
     executor moved out of the core into lmlab-dask).

1.23: ``usable_cores`` (``lmlab.api.executor``): the cores this process may run on, its CPU affinity,
     for the threads an executor hands its jobs (lmlab-dask and lmlab-slurm share them out by it).
"""

API_VERSION = "1.23"
