"""PEFT runs end to end (lmlab-peft): every method trains from a manifest with the loss going down and
only its own parameters changing; checkpoints hold the adapter alone and a run resumed from one ends
exactly where an uninterrupted run does; `lmlab merge` writes a plain model equal to the adapted one
and `lmlab generate` runs both; bad targets and unsupported layouts exit 2 naming the key."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lmlab import checkpoint, manifest
from lmlab.api import UserError, hookimpl
from lmlab.cli.main import main
from lmlab.assemble import build_model
from lmlab.train import adapters, runner
from conftest import CORPUS, tiny_toml
from support import run_cli

pytest.importorskip("lmlab_peft")

BASE = tiny_toml("{data}", name="base", seed=4, steps=40, batch_size=8, warmup_steps=4, eval_every=40,
                 checkpoint_every=40, sample_tokens=0) + """
[ffn]
use = "swiglu"
hidden = 64

[optimizer]
use = "adamw"
lr = 1e-2
"""

# PEFT adapts a trained model: this one starts from the base above (its shape, tokenizer and weights).
MANIFEST = """
name = "peft"
seed = 5

[init]
from = "{base}"

[data]
use = "text-file"
path = "{data}"

[model]
{model_extra}

[optimizer]
use = "adamw"
lr = {lr}

[train]
max_steps = {steps}
batch_size = 16
warmup_steps = 2
lr_schedule = "constant"
eval_every = {steps}
eval_steps = 2
checkpoint_every = 3
log_every = 1
sample_tokens = 0

[tracker]
use = "none"

[peft]
{peft}
"""

METHODS = {
    "lora": 'use = "lora"\nr = 4\nalpha = 8\ntargets = "all"',
    "dora": 'use = "dora"\nr = 4\ntargets = ["q", "v", "up", "down"]',
    "ia3": 'use = "ia3"\ntargets = ["k", "v", "up", "down"]',
    "loha": 'use = "loha"\nr = 4\ntargets = ["q", "v", "down"]',
    "lokr": 'use = "lokr"\nr = 4\ntargets = ["q", "v", "down"]',
    "adalora": 'use = "adalora"\ninit_r = 6\ntarget_r = 3\ntinit = 2\ntfinal = 3\ntargets = ["q", "v", "down"]',
    "adapter": 'use = "adapter"\nsize = 8\ndropout = 0.1',
    "qlora": 'use = "qlora"\nr = 4\nblocksize = 32',
}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A briefly pretrained model (40 steps) for the PEFT runs to adapt."""
    root = tmp_path_factory.mktemp("peft-base")
    corpus = root / "tiny.txt"
    corpus.write_text(CORPUS.read_text()[:60_000])
    (root / "base.toml").write_text(BASE.format(data=corpus))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "lmlab-cache"))
        (variant,) = manifest.load(root / "base.toml")
        runner.run_variant(variant, root / "runs" / "default")
    # The fine-tune's data differs from the pretraining's, as it would: one verse, over and over.
    verse = root / "verse.txt"
    verse.write_text("the quality of mercy is not strained.\nit droppeth as the gentle rain from heaven.\n" * 400)
    return root / "runs" / "default", verse


def write(tmp_path, base_run, peft: str, steps: int = 12, model_extra: str = "", lr: float = 3e-2):
    base, corpus = base_run
    path = tmp_path / "peft.toml"
    path.write_text(MANIFEST.format(base=base, data=corpus, steps=steps, peft=peft, model_extra=model_extra, lr=lr))
    return path


class Snapshot:
    """The model's state right after it was built and adapted (lmlab_model_built runs after [peft])."""

    state: dict | None = None

    @hookimpl
    def lmlab_model_built(self, model):
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}


class StopAt:
    """Interrupts a run, as Ctrl-C would, after optimizer step ``step``."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def lmlab_train_batch_end(self, step):
        if step == self.step:
            raise KeyboardInterrupt


def fixed_batch_loss(model, tokens, n: int = 16) -> float:
    val = torch.from_numpy(tokens.train[: n * 17].astype("int64")).view(n, 17)
    model.eval()
    with torch.no_grad():
        logits = model(val[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), val[:, 1:].reshape(-1)).item()


def train_losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train_loss"] for line in lines if "train_loss" in line]


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_trains_only_its_adapter_from_a_manifest(method, tmp_path, base_run, capsys):
    # Scales (ia3) and SVD triplets that start at zero (adalora) move slowly: higher learning rates.
    lr = {"ia3": 0.1, "adalora": 0.3}.get(method, 3e-2)
    (variant,) = manifest.load(write(tmp_path, base_run, METHODS[method], lr=lr))
    snapshot = Snapshot()
    run_dir = tmp_path / "runs" / "default"
    result = runner.run_variant(variant, run_dir, extra_hooks=[snapshot])
    model, plugin, summary = result.module.model, result.plugins["peft"], result.summary
    assert summary["status"] == "completed"

    # The loss goes down: on a fixed batch of the training data (no sampling noise), the adapted model
    # as it was built against the trained one.
    before = _loss_of_state(variant, result, snapshot.state)
    after = fixed_batch_loss(model, result.tokens)
    assert after < before - 0.02, (before, after)  # measured: 0.03 (ia3) to 0.09 (lora, qlora) in 12 steps

    # Only the adapter changed, every trainable parameter of it did, and nothing else.
    final = model.state_dict()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(plugin.is_adapter_key(n) for n in trainable)
    for key, value in final.items():
        if plugin.is_adapter_key(key):
            pruned = method == "adalora" and "lora_E" in key and not value.any()  # its rank went elsewhere
            assert key not in trainable or pruned or not torch.equal(value, snapshot.state[key]), key
        else:
            assert torch.equal(value, snapshot.state[key]), key

    # What the run reports and keeps.
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert summary["trainable_params"] == n_trainable < summary["params"] / 4
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    assert 8 * n_trainable <= summary["optimizer_state_bytes"] <= 8 * n_trainable + 8 * tensors  # AdamW: 2 moments
    checkpoints = run_dir / "checkpoints"
    assert summary["adapter_bytes"] == (checkpoints / "adapter.safetensors").stat().st_size
    last = torch.load(checkpoints / "last.ckpt", weights_only=True)
    saved = {k.removeprefix("model.") for k in last["state_dict"]}
    assert saved == {k for k in final if plugin.is_adapter_key(k)}
    assert last["lmlab_peft"]["plugin"] == method

    # `lmlab generate` runs the unmerged run; `lmlab merge` writes a plain model that computes the same.
    assert main(["generate", str(run_dir), "--prompt", "the ", "--max-new-tokens", "4"]) == 0
    code = main(["merge", str(run_dir)])
    if method == "adapter":
        assert code == 2 and "cannot fold its adapter" in capsys.readouterr().err
        return
    assert code == 0
    merged = json.loads((run_dir.with_name("default-merged") / "merge.json").read_text())
    assert merged["max_abs_logit_difference"] <= 1e-5
    assert main(["generate", str(run_dir.with_name("default-merged")), "--prompt", "the ",
                 "--max-new-tokens", "4"]) == 0


def _loss_of_state(variant, result, state) -> float:
    """The fixed-batch loss of the adapted model as it was built (the snapshot), rebuilt from scratch."""
    plugins = {slot: variant.instantiate(slot) for slot in variant.slots}
    model = build_model(variant.model, result.module.model.shape, plugins)
    plugins["peft"].apply(model, variant)
    model.load_state_dict(state, strict=False)
    for key, value in model.state_dict().items():  # strict=False tolerates 4-bit bookkeeping entries only
        assert key in state, key
    return fixed_batch_loss(model, result.tokens)


@pytest.mark.parametrize("method", ["lora", "adalora", "qlora"])
def test_a_run_resumed_from_its_adapter_checkpoint_continues_identically(method, tmp_path, base_run):
    peft = METHODS[method] + ("\ndropout = 0.1" if method == "lora" else "")
    path = write(tmp_path, base_run, peft, steps=10, model_extra="dropout = 0.1\n")
    (variant,) = manifest.load(path)
    reference = runner.run_variant(variant, tmp_path / "ref").summary

    run_dir = tmp_path / "stopped"
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        runner.run_variant(manifest.load(path)[0], run_dir, extra_hooks=[StopAt(7)])
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 6
    plugin = variant.instantiate("peft")
    assert last["lmlab_peft"]["plugin"] == method and all(plugin.is_adapter_key(k.removeprefix("model."))
                                                           for k in last["state_dict"])  # the adapter alone
    resumed = runner.run_variant(manifest.load(path)[0], run_dir, resume=True).summary
    assert resumed["status"] == "completed" and resumed["steps"] == 10
    assert train_losses(run_dir) == train_losses(tmp_path / "ref")
    assert resumed["val_loss"] == reference["val_loss"]


def test_the_adapter_file_round_trips_into_a_freshly_adapted_base(tmp_path, base_run):
    (variant,) = manifest.load(write(tmp_path, base_run, METHODS["lora"] + "\ndropout = 0.1", steps=6))
    run_dir = tmp_path / "runs" / "default"
    result = runner.run_variant(variant, run_dir)
    tensors, metadata = adapters.read_file(run_dir / "checkpoints" / "adapter.safetensors")
    assert metadata["peft"] == "lora" and metadata["step"] == "6"
    assert json.loads(metadata["options"])["r"] == 4
    trained = result.module.model
    assert set(tensors) == {k for k in trained.state_dict() if result.plugins["peft"].is_adapter_key(k)}

    # The base file holds the weights the adapter went onto: the [init]'s.
    base, _ = adapters.read_file(run_dir / "checkpoints" / "base.safetensors")
    init_state, _ = checkpoint.model_state(checkpoint.best_or_last(base_run[0]))
    assert base.keys() == init_state.keys() and all(torch.equal(base[k], init_state[k]) for k in base)
    # An adapter checkpoint is not a whole model: starting another run from it asks for a merge first.
    with pytest.raises(UserError, match="holds only a lora adapter, not a whole model; fold it into the base "
                                        "weights first: lmlab merge"):
        checkpoint.model_state(run_dir / "checkpoints" / "last.ckpt")

    plugins = {slot: variant.instantiate(slot) for slot in variant.slots}
    fresh = build_model(variant.model, trained.shape, plugins)
    fresh.load_state_dict(base)
    plugins["peft"].apply(fresh, variant)
    missing = fresh.load_state_dict(tensors, strict=False).missing_keys
    assert not [k for k in missing if plugins["peft"].is_adapter_key(k)]
    x = torch.randint(0, trained.vocab_size, (2, 16))
    trained.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), trained(x))


def test_peft_none_trains_the_whole_model_as_without_a_peft_table(tmp_path, base_run):
    (variant,) = manifest.load(write(tmp_path, base_run, 'use = "none"', steps=3))
    result = runner.run_variant(variant, tmp_path / "runs")
    summary = result.summary
    assert summary["trainable_params"] == summary["params"] and "adapter_bytes" not in summary
    assert summary["optimizer_state_bytes"] >= 8 * summary["params"]
    assert not (tmp_path / "runs" / "checkpoints" / "base.safetensors").exists()
    assert "lmlab_peft" not in torch.load(tmp_path / "runs" / "checkpoints" / "last.ckpt", weights_only=True)


def test_a_target_that_matches_no_module_exits_2_listing_the_roles(tmp_path, base_run, capsys):
    path = write(tmp_path, base_run, 'use = "lora"\ntargets = ["q", "c_fc"]')
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmlab: error:")]
    assert errors == ["lmlab: error: peft.targets: role 'c_fc' matches no module of this model; the roles it "
                      "has are attention: q, k, v, o; ffn: gate, up, down"]


def test_qlora_under_fsdp_is_refused_before_training_naming_peft_use(tmp_path, base_run):
    path = write(tmp_path, base_run, METHODS["qlora"])
    result = run_cli("run", str(path), "--out", str(tmp_path / "runs"), "--set", "parallel.use=fsdp",
                     env={"LMLAB_CACHE": str(tmp_path / "cache")}, timeout=240)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert errors[0].startswith("lmlab: error: peft.use: peft plugin 'qlora' works under parallel single, ddp, "
                                "not 'fsdp'")
    assert not (tmp_path / "runs" / "default" / "checkpoints").exists()


def test_checking_a_peft_manifest_imports_neither_peft_nor_bitsandbytes(tmp_path, base_run):
    path = write(tmp_path, base_run, METHODS["qlora"])
    code = ("import sys; from lmlab.cli.main import main; assert main(['check', '-q', sys.argv[1]]) == 0; "
            "heavy = {'peft', 'bitsandbytes', 'lightning', 'transformers'} & set(sys.modules); "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.exclusive
@pytest.mark.slow  # two runs of three processes: about 45 s here
def test_lora_under_ddp_trains_what_one_device_trains(tmp_path):
    from lmlab.testing import check_parallel_matches_single

    # Two processes with batch B each against one with 2B, step by step; then generate from the run.
    check_parallel_matches_single('use = "ddp"\ndevices = 2\naccelerator = "cpu"', tmp_path, steps=8,
                                  extra_manifest='[peft]\nuse = "lora"\nr = 4\ntargets = "all"\n')


def test_assemble_gives_the_model_a_run_trains_with_its_init_weights_and_adapter(tmp_path, base_run):
    from lmlab.assemble import assemble

    (variant,) = manifest.load(write(tmp_path, base_run, METHODS["lora"], steps=2))
    run_dir = tmp_path / "runs" / "default"
    built = assemble(variant, data=True, train_dir=run_dir)
    init_state, _ = checkpoint.model_state(checkpoint.best_or_last(base_run[0]))
    state = built.model.state_dict()
    adapter = {k for k in state if built.peft.is_adapter_key(k)}
    assert adapter and built.adapter.plugin is built.peft and built.init["format"] == "lmlab run"
    # Every base weight is the [init]'s, frozen; only the adapter trains.
    base = {k.replace(".base_layer", ""): v for k, v in state.items() if k not in adapter}
    assert base.keys() == init_state.keys() and all(torch.equal(base[k], init_state[k]) for k in base)
    assert {n for n, p in built.model.named_parameters() if p.requires_grad} == adapter

    # And it is the model the run trains: the hook sees the same weights, adapter included.
    snapshot = Snapshot()
    torch.manual_seed(variant.seed)
    again = assemble(variant, data=True, train_dir=tmp_path / "again").model.state_dict()
    runner.run_variant(variant, run_dir, extra_hooks=[snapshot])
    assert snapshot.state.keys() == again.keys()
    assert all(torch.equal(snapshot.state[k], again[k]) for k in again)
