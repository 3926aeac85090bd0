"""RLHF on the Shakespeare instruction task, measured: SFT, then a reward model, then DPO and PPO.

Runs the chain of experiments/alignment-base.toml → alignment-sft.toml → alignment-reward.toml →
alignment.toml (DPO and PPO from the same SFT run; finished runs are not trained again), then scores
every policy on the held-out pairs (data/shakespeare-prefs/heldout.jsonl.gz, prompts of lines no
training pair has) with the same yardsticks:

- preference accuracy: the share of held-out pairs whose chosen answer the policy finds likelier than
  the rejected one (summed log-probabilities of the answer's tokens);
- implicit reward accuracy (DPO's: log π/π_SFT higher for the chosen answer), for the tuned policies;
- reward: the reward model's mean score of answers sampled from the policy (temperature 1) for the
  held-out prompts, and their KL to the SFT run (the mean over answers of Σ log π − log π_SFT, an
  unbiased estimate of KL(π ‖ π_SFT) per answer);
- exact match: greedy answers against the held-out instruction records
  (data/shakespeare-sft/heldout.jsonl.gz), the task's own measure.

The reward model's held-out pair accuracy is printed too. Everything goes through the CLI (`lmlab run`,
`lmlab eval` with `--set` to score a run under another objective), as a user would do it.

    python bench/alignment.py [--limit N]

The runs go to runs/ at the repository root, where the manifests' [init] tables look for them.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
PAIRS = ROOT / "data" / "shakespeare-prefs" / "heldout.jsonl.gz"
RECORDS = ROOT / "data" / "shakespeare-sft" / "heldout.jsonl.gz"
AS_PAIRS = ["data.use=preferences", 'data.prompt_template="{prompt}"', 'data.response_end="\\n"']


def lmlab(*args: str) -> str:
    print("$ lmlab " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "lmlab", *args], check=True, capture_output=True, text=True)
    return done.stdout


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def scores(run: Path, data: Path, overrides: list[str], limit: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scores.json"
        lmlab("eval", str(run), "--data", str(data), "--out", str(out), *sets(*overrides),
              *(["--limit", str(limit)] if limit else []))
        return json.loads(out.read_text())


def exact_match(run: Path, limit: int | None) -> float:
    overrides = ["data.use=alpaca", 'data.prompt_template="{instruction}\\n{input}"', 'data.response_end="\\n"',
                 "objective.use=sft"]
    printed = lmlab("eval", str(run), "--data", str(RECORDS), *sets(*overrides),
                    *(["--limit", str(limit)] if limit else []))
    return float(re.search(r"exact match ([0-9.]+)", printed).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="score only the first N held-out records")
    parser.add_argument("--policies", type=Path, default=None,
                        help="score the variants in this folder (another stage-3 sweep) instead of runs/alignment")
    args = parser.parse_args()
    runs = ROOT / "runs"
    for stage in ("alignment-base", "alignment-sft", "alignment-reward", "alignment"):
        if stage != "alignment" or args.policies is None:
            lmlab("run", str(EXPERIMENTS / f"{stage}.toml"), "--out", str(runs / stage))
    sft, reward = runs / "alignment-sft" / "default", runs / "alignment-reward" / "default"
    policies = {"sft": sft}
    for variant in sorted((args.policies or runs / "alignment").iterdir()):
        if (variant / "summary.json").is_file():
            policies[json.loads((variant / "summary.json").read_text())["plugins"]["objective"]["name"]] = variant
    rm = scores(reward, PAIRS, [], args.limit)
    print(f"\nreward model: held-out pair accuracy {rm['val_accuracy']:.4f} over {rm['records']} pairs "
          f"(mean margin {rm['val_margin']:.3f})\n")
    rows = []
    for name, run in policies.items():
        pairs = scores(run, PAIRS, [*AS_PAIRS, "objective.use=dpo", f"objective.reference={json.dumps(str(sft))}"],
                       args.limit)
        sampled = scores(run, PAIRS, [*AS_PAIRS, "objective.use=ppo", f"objective.reward_run={json.dumps(str(reward))}",
                                      f"objective.reference={json.dumps(str(sft))}", "objective.max_new_tokens=24",
                                      "decoding.use=sample", "decoding.temperature=1.0"], args.limit)
        rows.append((name, pairs["val_policy_accuracy"], pairs["val_reward_accuracy"], sampled["val_reward"],
                     sampled["val_kl"], sampled["val_response_length"], exact_match(run, args.limit)))
    print("| policy | preference accuracy | implicit reward accuracy | reward (sampled) | KL to SFT | "
          "answer tokens | exact match |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, accuracy, implicit, score, kl, length, em in rows:
        implicit_text = "" if name == "sft" else f"{implicit:.4f}"
        print(f"| {name} | {accuracy:.4f} | {implicit_text} | {score:.3f} | {kl:.3f} | {length:.1f} | {em:.4f} |")


if __name__ == "__main__":
    main()
