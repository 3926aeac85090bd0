"""The architecture slot: today's model bit-identical through the `decoder` plugin, parallel blocks,
layer patterns of nested mixer tables (validated, checked, recorded), and a third party's
architecture written against lmlab.api alone."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmlab import manifest
from lmlab.api import MixerContext, UserError
from lmlab.assemble import assemble
from support import refused, run_cli
from test_discovery import fake_dist

ROOT = Path(__file__).resolve().parents[1]

# Each attention-ablation variant's model as the core built it before the architecture slot (commit
# 74d350b): the float64 sum of |weights| at init and the losses of three AdamW steps on fixed tokens.
GOLDEN = {
    'attention.use=mha,seed=1': (10720.605108065969, [4.2166643142700195, 3.5609524250030518, 3.3314859867095947]),
    'attention.use=mha,seed=2': (10723.002282080804, [4.184741020202637, 3.5373423099517822, 3.172921895980835]),
    'attention.use=mha,seed=3': (10727.01194454146, [4.238854885101318, 3.5514161586761475, 3.280608654022217]),
    'attention.use=gqa,seed=1': (9674.178347216355, [4.2057318687438965, 3.497232675552368, 3.1737136840820312]),
    'attention.use=gqa,seed=2': (9681.046627269312, [4.2075653076171875, 3.495194911956787, 3.1690709590911865]),
    'attention.use=gqa,seed=3': (9679.62368032092, [4.174783229827881, 3.5315611362457275, 3.2176239490509033]),
    'attention.use=mqa,seed=1': (9146.69330860997, [4.222870826721191, 3.5285842418670654, 3.205148935317993]),
    'attention.use=mqa,seed=2': (9150.610077922065, [4.196048736572266, 3.4875283241271973, 3.173402786254883]),
    'attention.use=mqa,seed=3': (9153.875103459533, [4.2115864753723145, 3.6006758213043213, 3.2117061614990234]),
    'attention.use=mamba,seed=1': (53265.43320765052, [4.216912269592285, 3.2902743816375732, 2.9002492427825928]),
    'attention.use=mamba,seed=2': (53335.21056242963, [4.207267761230469, 3.30684232711792, 2.9268670082092285]),
    'attention.use=mamba,seed=3': (53325.312384113204, [4.206223011016846, 3.2989308834075928, 2.9127678871154785]),
}


def _built(path, *sets: str):
    (variant,) = manifest.load(Path(path), list(sets))
    torch.manual_seed(variant.seed)
    return assemble(variant, vocabulary_unknown_ok=True)


def _steps(model, vocab: int, n: int = 3) -> list[float]:
    x = torch.randint(0, vocab, (4, 33), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(n):
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def test_the_attention_ablation_builds_and_trains_bit_identically_through_the_decoder_architecture():
    variants = manifest.load(ROOT / "experiments" / "attention-ablation.toml", ["model.vocab_size=65"])
    assert [v.name for v in variants] == list(GOLDEN)
    for variant in variants:
        table = variant.manifest["architecture"]
        assert (table["use"], table["layers"], table["mixers"], table["exit_layers"]) == ("decoder", "", {}, [])
        torch.manual_seed(variant.seed)
        built = assemble(variant, model=False, vocabulary_unknown_ok=True)
        torch.manual_seed(variant.seed)
        model = built.build_model()
        init = sum(float(p.double().abs().sum()) for p in model.state_dict().values())
        want_init, want_losses = GOLDEN[variant.name]
        # Float64 sums of the same float32 weights: equal to rounding (1e-12), while any change in what
        # is built or in which order the random init draws moves them by far more.
        assert init == pytest.approx(want_init, rel=1e-12), variant.name
        assert _steps(model, 65) == pytest.approx(want_losses, rel=1e-6), variant.name


def _tiny(tmp_path: Path, tables: str, name: str = "m.toml", train: str = "") -> Path:
    path = tmp_path / name
    path.write_text(f"""name = "arch"
seed = 3
[data]
use = "text-file"
path = "{ROOT / 'data' / 'tinyshakespeare.txt'}"
[model]
n_layers = 4
n_heads = 2
d_model = 32
block_size = 16
vocab_size = 65
[position]
use = "none"
[train]
max_steps = 4
batch_size = 2
eval_every = 4
eval_steps = 1
sample_tokens = 0
{train}
[tracker]
use = "none"
""" + tables)
    return path


def test_a_parallel_block_is_x_plus_mixer_plus_ffn_of_one_norm_and_checkpoints_its_ffn(tmp_path):
    model = _built(_tiny(tmp_path, '[architecture]\nuse = "parallel-block"\n')).model
    block = model.blocks[1]
    x = torch.randn(2, 8, 32)
    ctx = MixerContext(position=model.position, positions=torch.arange(8), start=0, causal=True)
    h = block.norm1(x)
    assert torch.allclose(block(x, ctx), x + block.attn(h, ctx, None) + block.ffn(h), atol=1e-6)
    assert not any("norm2" in name for name, _ in model.named_parameters())  # one norm per block

    calls = []
    for b in model.blocks:
        b.ffn.register_forward_pre_hook(lambda *_: calls.append(1))
    model.train()
    tokens = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(policy: str):
        model.set_checkpointing(policy)
        model.zero_grad()
        calls.clear()
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()], len(calls)

    plain, grads, n_plain = step("none")
    again, grads_ckpt, n_ckpt = step("ffn")
    assert n_plain == 4 and n_ckpt == 8  # each ffn ran again in backward: its activations were not kept
    assert again == pytest.approx(plain, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, grads_ckpt))


HYBRID = """[architecture]
use = "decoder"
layers = "MMA"
[architecture.mixers.M]
use = "mamba"
d_state = 8
[architecture.mixers.A]
use = "gqa"
n_kv_heads = 1
"""


def test_a_layer_pattern_gives_each_layer_its_nested_tables_mixer_and_decodes_like_the_full_forward(tmp_path):
    built = _built(_tiny(tmp_path, HYBRID, "h.toml"), "model.n_layers=6")
    model = built.model.eval()
    kinds = [type(b.attn).__name__ for b in model.blocks]
    assert kinds == ["MambaMixer", "MambaMixer", "SelfAttention"] * 2
    assert model.blocks[0].attn.d_state == 8 and model.blocks[2].attn.n_kv_heads == 1
    # the resolved nested tables, every default filled in, are what the run records
    mixers = built.variant.manifest["architecture"]["mixers"]
    assert mixers["M"]["use"] == "mamba" and mixers["M"]["d_state"] == 8 and "d_conv" in mixers["M"]
    assert mixers["A"] == {"use": "gqa", "n_kv_heads": 1, **{k: v for k, v in mixers["A"].items()
                                                            if k not in ("use", "n_kv_heads")}}
    tokens = torch.randint(0, 65, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 16)
        steps = [model(tokens[:, :5], cache)] + [model(tokens[:, i:i + 1], cache) for i in range(5, 12)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-4)


@pytest.mark.parametrize("change, key", [
    ('d_state = "big"', "architecture.mixers.M.d_state"),
    ('colour = 3', "architecture.mixers.M.colour"),
    ('use = "mamba2"', "architecture.mixers.M.use"),
])
def test_a_bad_nested_table_is_refused_naming_its_dotted_key(tmp_path, change, key):
    text = HYBRID.replace('d_state = 8', change) if "use" not in change else HYBRID.replace('use = "mamba"', change)
    with pytest.raises(UserError) as info:
        manifest.load(_tiny(tmp_path, text), [])
    assert info.value.key == key


@pytest.mark.parametrize("sets, key", [
    (["architecture.layers=MMX"], "architecture.layers"),  # a label without a table
    (["model.n_layers=4"], "architecture.layers"),  # 3 does not divide 4
    (["architecture.layers=MM"], "architecture.mixers.A"),  # a table the pattern never uses
    (["position.use=rope", "model.n_layers=6"], "position.use"),  # the nested mamba's own check, as at the top level
])
def test_lmlab_check_refuses_a_pattern_that_cannot_be_laid_out(tmp_path, sets, key):
    path = _tiny(tmp_path, HYBRID)
    refused(run_cli("check", str(path), *[a for s in sets for a in ("--set", s)]), key)


def test_a_hybrid_run_records_every_distribution_it_was_built_from(tmp_path):
    path = _tiny(tmp_path, HYBRID.replace('layers = "MMA"', 'layers = "MA"'))
    result = run_cli("run", str(path), "--out", str(tmp_path / "runs"), "--set", "model.n_layers=2")
    assert result.returncode == 0, result.stderr[-2000:]
    run = tmp_path / "runs" / "default"
    provenance = json.loads((run / "provenance.json").read_text())["plugins"]["architecture"]
    assert provenance["name"] == "decoder" and provenance["distribution"] == "lmlab-architectures"
    assert {k: v["distribution"] for k, v in provenance["components"].items()} == \
        {"mixers.M": "lmlab-mamba", "mixers.A": "lmlab-attention"}
    # the recorded manifest loads back: the run folder generates from its own nested tables
    out = run_cli("generate", str(run), "--prompt", "To", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr[-2000:]


THIRD_PARTY = '''
import torch
from torch.utils.checkpoint import checkpoint

from lmlab.api import Architecture, ModelParts
from lmlab.api.architecture import Block, Stack


class SharedNormBlock(Block):
    """GPT-J's block, as a third party writes it: one norm, both branches from it."""

    def forward(self, x, ctx, state=None):
        h = self.norm1(x)
        mixed = self.attn(h, ctx, state)
        if self.checkpointing == "ffn" and self.training and torch.is_grad_enabled():
            return x + mixed + checkpoint(self.ffn, h, use_reentrant=False)
        return x + mixed + self.ffn(h)


class Gptj(Architecture):
    api = ">=1.18,<2"
    families = ("decoder",)

    def build(self, parts: ModelParts):
        return Stack(parts.shape, position=parts.position, attention=parts.attention, ffn=parts.ffn,
                     norm=parts.norm, norm_eps=parts.norm_eps, tie_embeddings=parts.tie_embeddings,
                     heads=parts.heads, block=SharedNormBlock)
'''


def test_a_third_party_parallel_block_keeps_its_moes_aux_loss_and_checkpoints_its_ffn(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    fake_dist(site, "lmlab-gptj", "lmlab_gptj", THIRD_PARTY, {"lmlab.architecture": {"gptj": "lmlab_gptj:Gptj"}})
    path = _tiny(tmp_path, '[architecture]\nuse = "gptj"\n[ffn]\nuse = "moe"\nn_experts = 4\ntop_k = 2\n',
                 train='checkpointing = "ffn"')
    env = {"PYTHONPATH": str(site)}
    assert run_cli("check", str(path), env=env).returncode == 0
    script = tmp_path / "probe.py"
    script.write_text(f'''
import json, sys, torch
from pathlib import Path
from lmlab import manifest
from lmlab.assemble import assemble
(variant,) = manifest.load(Path({str(path)!r}), [])
model = assemble(variant, vocabulary_unknown_ok=True).model.train()
model.set_checkpointing(variant.train.checkpointing)
calls = []
for b in model.blocks:
    b.ffn.register_forward_pre_hook(lambda *_: calls.append(1))
out = model(torch.randint(0, 65, (2, 16)))
aux = model.aux_loss()
experts = sum(float(b.ffn.aux_loss) for b in model.blocks)
(out.logsumexp(-1).mean() + aux).backward()
print(json.dumps({{"aux": float(aux), "experts": experts, "calls": len(calls), "blocks": len(model.blocks),
                  "type": type(model.blocks[0]).__name__}}))
''')
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["type"] == "SharedNormBlock"
    assert seen["aux"] > 0 and seen["aux"] == pytest.approx(seen["experts"], rel=1e-6)  # every MoE's loss counted
    assert seen["calls"] == 2 * seen["blocks"]  # checkpointing = "ffn": each ffn ran again in backward
    summary = run_cli("run", str(path), "--out", str(tmp_path / "runs"), env=env)
    assert summary.returncode == 0, summary.stderr[-2000:]
    provenance = json.loads((tmp_path / "runs" / "default" / "provenance.json").read_text())
    assert provenance["plugins"]["architecture"]["distribution"] == "lmlab-gptj"


def test_auxiliary_losses_are_gathered_from_every_module_of_a_block_not_only_its_ffn(tmp_path):
    model = _built(_tiny(tmp_path, "")).model
    assert model.aux_loss() is None
    model.blocks[1].attn.aux_loss = torch.tensor(2.0)  # a mixer with a router of its own (MoA, a MoE-Mamba)
    model.blocks[3].ffn.aux_loss = torch.tensor(0.5)
    assert float(model.aux_loss()) == 2.5


def test_the_schema_types_nested_tables_by_the_plugin_they_name(tmp_path):
    import tomllib

    import jsonschema

    from lmlab.schema import manifest_schema

    validator = jsonschema.Draft202012Validator(manifest_schema(warn=lambda message: None))
    document = tomllib.loads(_tiny(tmp_path, HYBRID).read_text())
    assert list(validator.iter_errors(document)) == []
    document["architecture"]["mixers"]["M"]["d_state"] = "big"
    assert [list(e.absolute_path) for e in validator.iter_errors(document)]
    del document["architecture"]["mixers"]["M"]["d_state"]
    del document["architecture"]["mixers"]["M"]["use"]  # a nested table must say which plugin it is
    assert list(validator.iter_errors(document))


def test_a_run_recorded_before_the_architecture_slot_still_generates(tmp_path):
    path = _tiny(tmp_path, "")
    assert run_cli("run", str(path), "--out", str(tmp_path / "runs"), "--set", "model.n_layers=1").returncode == 0
    run = tmp_path / "runs" / "default"
    recorded = (run / "manifest.toml").read_text()
    # as lmlab wrote it before API 1.18: no [architecture] tables ...
    old = re.sub(r"\[architecture(\.\w+)*\]\n(.+\n)*\n", "", recorded)
    assert "architecture" not in old
    old = old.replace("[model]\n", "[model]\nshare_embeddings = true\n", 1)  # ... and its keys in [model]
    (run / "manifest.toml").write_text(old)
    out = run_cli("generate", str(run), "--prompt", "To", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr[-2000:]
    # a manifest a user writes is held to today's keys
    refused(run_cli("check", str(run / "manifest.toml")), "model.share_embeddings")
    # and the same manifest run again finds its run done, not "a run of a different manifest"
    provenance = json.loads((run / "provenance.json").read_text())
    del provenance["manifest"]["architecture"]
    provenance["manifest"]["model"].update(architecture=None, encoder_layers=None, share_embeddings=True,
                                           decoder_start_id=None)
    (run / "provenance.json").write_text(json.dumps(provenance))
    again = run_cli("run", str(path), "--out", str(tmp_path / "runs"), "--set", "model.n_layers=1")
    assert again.returncode == 0, again.stderr[-2000:]
