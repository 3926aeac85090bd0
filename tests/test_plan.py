"""`lmlab plan`: per-device memory and per-step communication before running, from the parallel
plugin's layout and what was measured on the model built on fake tensors."""

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from lmlab import manifest
from lmlab.assemble import assemble
from lmlab.api import Parallel, UserError
from lmlab.api.layout import Collective, MemoryLayout
from lmlab.cli.main import main
from lmlab.plan import ModelFacts, estimate, parse_size, plan_variant

GB = 1e9

PLAN_MANIFEST = """
name = "plan"

[data]
use = "text-file"
path = "{data}"

[model]
n_layers = {n_layers}
d_model = {d_model}
n_heads = {n_heads}
block_size = {block_size}
vocab_size = {vocab_size}

[train]
batch_size = {batch_size}
{train}

[parallel]
{parallel}
"""


@pytest.fixture
def plan_manifest(tmp_path, corpus_slice):
    def write(parallel: str = 'use = "single"', train: str = "", n_layers: int = 2, d_model: int = 64,
              n_heads: int = 4, block_size: int = 32, vocab_size: int | None = 96, batch_size: int = 4,
              extra: str = "") -> str:
        path = tmp_path / "plan.toml"
        text = PLAN_MANIFEST.format(data=corpus_slice, parallel=parallel, train=train, n_layers=n_layers,
                                    d_model=d_model, n_heads=n_heads, block_size=block_size,
                                    vocab_size=vocab_size, batch_size=batch_size) + extra
        if vocab_size is None:  # the tokenizer's (fitted on the corpus)
            text = text.replace("vocab_size = None\n", "")
        path.write_text(text)
        return str(path)

    return write


def _plan(path: str, devices: int | None = None, overrides=()):
    (variant,) = manifest.load(path, list(overrides))
    return plan_variant(variant, devices)


# --- the arithmetic: the ZeRO paper's numbers ---------------------------------------------------------


def _zero(stage: int, n: int, **extra) -> MemoryLayout:
    """DeepSpeed-style mixed precision: 16-bit parameters and gradients, fp32 master weights with the
    optimizer state (Adam: K = 4 + 8 = 12 bytes per parameter), the first `stage` of them sharded."""
    return MemoryLayout(devices=n, params=1 / n if stage >= 3 else 1.0, grads=1 / n if stage >= 2 else 1.0,
                        optimizer=1 / n if stage >= 1 else 1.0, param_dtype="float16", grad_dtype="float16",
                        master_weights=True, **extra)


def _adam_facts(psi: float) -> ModelFacts:
    return ModelFacts(params=int(psi), trainable=int(psi), optimizer_bytes=int(8 * psi))  # two fp32 moments


def test_a_13b_fp16_model_under_zero2_on_32_devices_holds_params_and_sharded_grads_and_optimizer_states():
    psi = 13e9
    plan = estimate(_adam_facts(psi), _zero(2, 32), "16-mixed")
    assert plan.params == pytest.approx(26 * GB)  # fp16 parameters, a full copy on every device
    assert plan.grads == pytest.approx(26 * GB / 32)  # fp16 gradients, sharded
    assert plan.optimizer == pytest.approx(156 * GB / 32)  # fp32 master + momentum + variance, sharded
    assert plan.model_states == pytest.approx((26 + 26 / 32 + 156 / 32) * GB)


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_model_states_per_device_match_the_zero_paper(stage, expected_gb):
    # Rajbhandari et al. 2020, figure 1: Ψ = 7.5B parameters, K = 12, Nd = 64 devices.
    psi, n = 7.5e9, 64
    plan = estimate(_adam_facts(psi), _zero(stage, n), "16-mixed")
    exact = {0: (2 + 2 + 12) * psi, 1: 2 * psi + 2 * psi + 12 * psi / n, 2: 2 * psi + (2 + 12) * psi / n,
             3: (2 + 2 + 12) * psi / n}[stage]
    assert plan.model_states == pytest.approx(exact)
    assert round(plan.model_states / GB, 1) == expected_gb


def test_communication_per_step_is_2_psi_for_ddp_and_zero2_and_3_psi_for_zero3():
    psi, n = 1e9, 8
    facts = _adam_facts(psi)
    ring = (n - 1) / n
    ddp = estimate(facts, MemoryLayout(devices=n, collectives=(Collective("all-reduce", "gradients", n),)), "32-true")
    assert ddp.comm_bytes == pytest.approx(2 * ring * 4 * psi)  # fp32 gradients
    zero2 = _zero(2, n, collectives=(Collective("reduce-scatter", "gradients", n),
                                     Collective("all-gather", "parameters", n)))
    assert estimate(facts, zero2, "16-mixed").comm_bytes == pytest.approx(2 * ring * 2 * psi)
    zero3 = _zero(3, n, collectives=(Collective("all-gather", "parameters", n, size=2, per="micro-batch"),
                                     Collective("reduce-scatter", "gradients", n, per="micro-batch")))
    assert estimate(facts, zero3, "16-mixed").comm_bytes == pytest.approx(3 * ring * 2 * psi)
    # once per micro-batch: gradient accumulation multiplies it
    assert estimate(facts, zero3, "16-mixed", grad_accum=4).comm_bytes == pytest.approx(4 * 3 * ring * 2 * psi)
    # one device: nothing to send
    assert estimate(facts, MemoryLayout(devices=1, collectives=(Collective("all-reduce", "gradients", 1),)),
                    "32-true").comm_bytes == 0


def test_offloading_moves_optimizer_states_to_host_memory():
    facts = _adam_facts(1e9)
    on_device = estimate(facts, _zero(2, 4), "bf16-mixed")
    offloaded = estimate(facts, _zero(2, 4, offload_optimizer=True), "bf16-mixed")
    assert offloaded.host == pytest.approx(on_device.optimizer)
    assert offloaded.phases["training"] == pytest.approx(on_device.phases["training"] - on_device.optimizer)


def test_the_peak_is_the_largest_moment_of_a_step():
    # Lightning zeroes gradients after the forward pass: at the end of it parameters, optimizer states,
    # activations and the previous step's gradients are all allocated.
    facts = ModelFacts(params=100, trainable=100, optimizer_bytes=800, activation_bytes=1000, transient_bytes=50)
    plan = estimate(facts, MemoryLayout(devices=1), "32-true")
    assert plan.phases["training"] == 400 + 800 + 1000 + 400
    assert plan.phases["optimizer step"] == 400 + 400 + 800
    assert plan.total == plan.phases["training"]
    persistent = estimate(facts, MemoryLayout(devices=1, persistent_grads=True), "32-true")
    assert persistent.total == 400 + 800 + 1000 + 400 + 50  # backward's working memory on top
    # DeepSpeed's engine frees gradients in its step: only backward's working memory adds to the activations
    freed = estimate(facts, MemoryLayout(devices=1, grads_freed_at_step=True), "32-true")
    assert freed.phases["training"] == 400 + 800 + 1000 + 50


# --- measuring the model ------------------------------------------------------------------------------


def test_parameters_and_optimizer_states_are_counted_on_the_real_model(plan_manifest):
    path = plan_manifest()
    plan = _plan(path)
    (variant,) = manifest.load(path)
    model = assemble(variant).model
    assert plan.facts.params == model.num_params()
    assert plan.device.params == 4 * model.num_params() + sum(b.numel() * 4 for b in model.buffers())
    assert plan.facts.optimizer_bytes == 8 * model.num_params()  # AdamW: two fp32 moments


@pytest.mark.parametrize("train", ["", 'precision = "bf16-mixed"', 'checkpointing = "ffn"'])
def test_activations_measured_on_fake_tensors_equal_what_a_real_forward_saves(plan_manifest, train):
    path = plan_manifest(train=train)
    plan = _plan(path)
    (variant,) = manifest.load(path)
    built = assemble(variant)
    built.model.set_checkpointing(variant.train.checkpointing)
    assert plan.facts.activation_bytes == _saved_bytes(built.model, built.objective, bf16="bf16" in train)


def _saved_bytes(model, objective, bf16: bool = False, vocab: int = 96) -> int:
    """Bytes autograd saves for backward in a real forward of a (4, 32) batch, parameters left out."""
    from lmlab.api import Windows
    from lmlab.model import compute_loss

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    windows = torch.randint(0, vocab, (4, 33))
    batch = (objective.make_batch_from(Windows(windows)) if objective.wants_windows() else objective.make_batch(windows))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        compute_loss(model, objective, batch)
    return total


def test_an_objectives_special_tokens_and_batches_are_planned_as_a_run_makes_them(plan_manifest):
    """mlm's [MASK] gets an id past the tokenizer's vocabulary, and its masked batch is what is measured."""
    path = plan_manifest(vocab_size=None, extra='\n[objective]\nuse = "mlm"\n\n[attention]\nuse = "mha"\n')
    plan = _plan(path)
    (variant,) = manifest.load(path)
    built = assemble(variant, data=True)  # the tokenizer fitted on the data, as a run's
    assert plan.shape.vocab_size == built.tokenizer.vocab_size + 1 == built.shape.vocab_size
    built.model.train()
    assert plan.facts.activation_bytes == _saved_bytes(built.model, built.objective, vocab=built.shape.vocab_size)


def test_a_lora_adapter_is_planned_as_a_run_applies_it(plan_manifest):
    """Only the adapter has gradients and optimizer states, and the frozen base saves fewer activations."""
    pytest.importorskip("lmlab_peft")

    path = plan_manifest(extra='\n[peft]\nuse = "lora"\nr = 4\ntargets = ["q", "v"]\n')
    plan, full = _plan(path), _plan(path, overrides=["peft.use=none"])
    (variant,) = manifest.load(path)
    built = assemble(variant)
    plugins, model = built.plugins, built.model
    plugins["peft"].apply(model, variant.manifest)
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.facts.trainable == trainable == 2 * 2 * (4 * 64 + 64 * 4)  # 2 layers x (q, v) x (A, B)
    assert plan.facts.params == sum(p.numel() for p in model.parameters())
    assert plan.facts.optimizer_bytes == 8 * trainable and plan.device.grads == 4 * trainable
    assert plan.facts.activation_bytes == _saved_bytes(model, plugins["objective"])
    assert plan.facts.activation_bytes < full.facts.activation_bytes


def test_an_adapter_that_cannot_be_built_on_fake_tensors_is_named_and_the_other_variants_planned(
        plan_manifest, capsys):
    pytest.importorskip("bitsandbytes")
    path = plan_manifest(extra='\n[sweep]\n"peft.use" = ["qlora", "lora"]\n')
    assert main(["plan", path]) == 2
    out, err = capsys.readouterr()
    assert "cannot plan: peft.use: cannot be measured on fake tensors" in out
    assert "# variant: peft.use=lora" in out and "trainable)" in out.split("peft.use=lora")[1]
    assert "peft.use" in err


def test_checkpointing_and_mixed_precision_shrink_activations_not_parameters(plan_manifest):
    base = _plan(plan_manifest())
    ffn = _plan(plan_manifest(train='checkpointing = "ffn"'))
    full = _plan(plan_manifest(train='checkpointing = "full"'))
    bf16 = _plan(plan_manifest(train='precision = "bf16-mixed"'))
    assert full.device.activations < ffn.device.activations < base.device.activations
    assert full.device.transient > base.device.transient  # one block is recomputed in backward
    assert bf16.device.activations < base.device.activations
    assert bf16.device.params == base.device.params  # autocast keeps fp32 parameters
    assert bf16.facts.activation_dtype == "bfloat16"


def test_ddp_keeps_gradients_in_buckets_and_all_reduces_them(plan_manifest):
    single = _plan(plan_manifest())
    ddp = _plan(plan_manifest(parallel='use = "ddp"\ndevices = 4'))
    assert ddp.device.layout.devices == 4
    assert ddp.device.params == single.device.params and ddp.device.grads == single.device.grads
    assert ddp.device.total == pytest.approx(single.device.total + single.device.transient)
    ((collective, volume),) = ddp.device.comm
    assert (collective.op, collective.of) == ("all-reduce", "gradients")
    assert volume == pytest.approx(2 * 3 / 4 * 4 * single.facts.trainable)
    # --devices overrides the plugin's own count; without bucket views DDP holds a second copy
    wide = _plan(plan_manifest(parallel='use = "ddp"\ndevices = 4\ngradient_as_bucket_view = false'), devices=16)
    assert wide.device.layout.devices == 16 and wide.device.grad_buffers == single.device.grads
    assert single.device.comm == []


def test_a_13b_parameter_model_is_planned_without_allocating_it(plan_manifest):
    path = plan_manifest(parallel='use = "ddp"\ndevices = 8', n_layers=40, d_model=5120, n_heads=40,
                         block_size=2048, vocab_size=32000, batch_size=1, train='precision = "bf16-mixed"')
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over an exec from the (large) test process.
    probe = ("import sys; from lmlab import manifest; from lmlab.plan import plan_variant; "
             "(v,) = manifest.load(sys.argv[1]); p = plan_variant(v); "
             "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]; "
             "print(p.facts.params, p.device.params, hwm)")
    result = subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    params, param_bytes, peak_kib = (float(x) for x in result.stdout.split())
    assert 12.5e9 < params < 13.5e9 and param_bytes > 50 * GB  # fp32 under autocast
    assert peak_kib < 2 * 2**20  # under 2 GiB of real memory for a 52 GB model


# --- the command --------------------------------------------------------------------------------------


def test_plan_prints_each_part_per_device_and_the_communication(plan_manifest, capsys):
    assert main(["plan", plan_manifest(parallel='use = "ddp"\ndevices = 2')]) == 0
    out = capsys.readouterr().out
    for line in ("parameters", "gradients", "optimizer states", "activations", "total", "all-reduce of gradients"):
        assert line in out, out
    assert "ddp on 2 devices" in out


def test_plan_warns_and_exits_1_when_a_variant_does_not_fit_device_memory(plan_manifest, capsys):
    path = plan_manifest(parallel='use = "ddp"\ndevices = 2')
    assert main(["plan", path, "--device-mem", "1MB"]) == 1
    out = capsys.readouterr().out
    (warning,) = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert "does not fit" in warning and "--device-mem 1MB" in warning
    assert main(["plan", path, "--device-mem", "80GB"]) == 0
    assert "fits:" in capsys.readouterr().out


def test_plan_plans_every_variant_of_a_sweep(plan_manifest, capsys):
    path = plan_manifest(extra='\n[sweep]\n"train.batch_size" = [2, 8]\n')
    assert main(["plan", path]) == 0
    out = capsys.readouterr().out
    assert "# variant: train.batch_size=2" in out and "# variant: train.batch_size=8" in out


@pytest.mark.parametrize("args, key", [
    (["--device-mem", "80 parsecs"], "--device-mem"),
    (["--device-mem", "0GB"], "--device-mem"),
    (["--devices", "0"], "--devices"),
    (["--set", "parallel.use=no-such-strategy"], "parallel.use"),
    (["--set", "model.d_model=1000000000", "--set", "model.n_heads=1"], "model.d_model"),  # over 2^63 bytes
])
def test_bad_input_is_one_line_naming_the_option(plan_manifest, capsys, args, key):
    assert main(["plan", plan_manifest(), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmlab: error: ") and key in err and err.count("\n") == 1, err


def test_a_parallel_plugin_without_a_layout_cannot_be_planned():
    class Opaque(Parallel):
        name = "opaque"

    with pytest.raises(UserError, match="does not describe its memory layout") as info:
        Opaque().memory_layout(None, None, "32-true")
    assert info.value.key == "parallel.use"


def test_sizes_are_decimal_or_binary_as_written():
    assert parse_size("80GB") == 80e9
    assert parse_size("80GiB") == parse_size("80G") == 80 * 2**30
    assert parse_size("512 MB") == 512e6
    with pytest.raises(UserError):
        parse_size("80")


def test_plan_imports_neither_lightning_nor_wandb_deepspeed_peft(plan_manifest):
    probe = ("import sys; from lmlab.cli.main import main; rc = main(['plan', sys.argv[1]]); "
             "heavy = {'lightning', 'wandb', 'deepspeed', 'peft'}; "
             "print(sorted(heavy & {m.split('.')[0] for m in sys.modules})); sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", probe, plan_manifest()],
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_a_forward_that_reads_tensor_values_is_measured_by_running_a_small_model_for_real(plan_manifest,
                                                                                          monkeypatch):
    from lmlab.plan import measure as planner

    path = plan_manifest(extra='\n[ffn]\nuse = "moe"\n')  # splits its rows by the tokens each expert got
    assert _plan(path).facts.activation_bytes > 0
    monkeypatch.setattr(planner, "REAL_FORWARD_LIMIT", 0)
    with pytest.raises(UserError, match="depends on tensor values") as info:
        _plan(path)
    assert info.value.key == "model"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_deepspeed_plugin_shards_as_zero_stage_says(plan_manifest, stage):
    pytest.importorskip("lmlab_deepspeed")
    path = plan_manifest(parallel=f'use = "deepspeed"\nstage = {stage}', train='precision = "bf16-mixed"')
    plan = _plan(path, devices=4)
    d, params = plan.device, plan.facts.params
    assert d.params == pytest.approx(2 * params / (4 if stage == 3 else 1) + plan.facts.buffer_bytes)
    assert d.grads == pytest.approx(2 * params / (4 if stage >= 2 else 1))  # bf16
    assert d.optimizer == pytest.approx(12 * params / 4)  # fp32 master + AdamW's two moments


@pytest.mark.parametrize("reshard", [True, False])
def test_the_fsdp_plugin_shards_everything_and_gathers_units(plan_manifest, reshard):
    pytest.importorskip("lmlab_fsdp")
    path = plan_manifest(parallel=f'use = "fsdp"\ndevices = 2\nreshard_after_forward = {str(reshard).lower()}',
                         n_layers=8)
    plan, single = _plan(path), _plan(plan_manifest(n_layers=8))
    assert plan.device.model_states == pytest.approx(single.device.model_states / 2)
    assert (plan.device.gathered < single.device.params) == reshard
    ops = [(c.op, c.of) for c, _ in plan.device.comm]
    assert ops == [("all-gather", "parameters"), ("reduce-scatter", "gradients")]


_BUCKETS = "reduce_bucket_size = 20_000_000\nallgather_bucket_size = 20_000_000"  # smaller than DeepSpeed's defaults


@pytest.mark.exclusive
@pytest.mark.parametrize("parallel", [
    'use = "single"\naccelerator = "cpu"',
    'use = "fsdp"\ndevices = 2\naccelerator = "cpu"',
    f'use = "deepspeed"\ndevices = 2\naccelerator = "cpu"\nstage = 3\n{_BUCKETS}',
], ids=["single", "fsdp", "deepspeed-zero3"])
def test_the_planned_peak_is_within_20_percent_of_what_a_small_run_measures(parallel, tmp_path):
    from lmlab.testing import check_plan_matches_measured

    plugin = parallel.split('"')[1]
    if not entry_points(group="lmlab.parallel", name=plugin):
        pytest.skip(f"the {plugin} plugin is not installed")
    # 12.7 M parameters (0.2 GB of fp32 AdamW model states), a micro-batch of 4 × 256 tokens.
    measured = check_plan_matches_measured(parallel, tmp_path, tolerance=0.2)
    assert measured.devices == (1 if plugin == "single" else 2)
