"""Start-up: how long `lmlab plugins` and `lmlab check` take and what they import; and, for a
training run as a whole process, lmlab against the hand-written script.

`lmlab plugins` must answer in under 0.5 s with every first-party plugin installed (it reads
entry-point metadata only); `lmlab check` imports the plugins its manifest names, and never
lightning, wandb, deepspeed or peft. Each command runs 5 times in a fresh interpreter; the median
is printed next to a bare `python -c pass` baseline measured the same way.

Then a 20-step training run of the quickstart model, as a whole process, three times each for
`lmlab run` and `bench/handwritten_train.py` (medians): the wall time, the time to the first
optimizer step and the time from the last step to exit (``bench/whole_process.py``), with the
import times of torch and of Lightning shown separately (``python -c "import ..."``), and what the
heavy dependencies cost inside ``lmlab run`` itself (``python -X importtime``: the largest
cumulative time of the package or one of its modules, so a package imported by another is counted in
both).

    python bench/startup.py
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import whole_process  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "lightning", "wandb", "deepspeed", "peft", "transformers", "sentencepiece")
PROBE = ("import sys; from lmlab.cli.main import main; main({argv!r}); "
         "print('IMPORTED', sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})), "
         "sorted({{m.split('.')[0] for m in sys.modules if m.startswith('lmlab_')}}), file=sys.stderr)")


def timed(cmd: list[str], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def imports(argv: list[str]) -> str:
    code = PROBE.format(argv=argv, heavy=HEAVY)
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    return next(line for line in err.splitlines() if line.startswith("IMPORTED"))[len("IMPORTED "):]


# Packages a training run may import, and the part of torch that only compiling needs.
RUN_PACKAGES = ("torch", "torch._dynamo", "numpy", "lightning", "torchmetrics", "transformers", "scipy",
                "matplotlib", "pydantic", "wandb", "peft", "deepspeed")


def run_imports(steps: int = 20) -> dict[str, float]:
    """Seconds each of RUN_PACKAGES took to import inside a ``steps``-step quickstart ``lmlab run``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        sets = ["tracker.use=none", "train.sample_tokens=0", f"train.max_steps={steps}", f"train.eval_every={steps}",
                "train.eval_steps=1", f"train.checkpoint_every={steps}"]
        cmd = [sys.executable, "-X", "importtime", "-m", "lmlab", "run", str(ROOT / "experiments" / "shakespeare-char.toml"),
               "--out", tmp, *[a for s in sets for a in ("--set", s)]]
        err = subprocess.run(cmd, capture_output=True, text=True, check=True, env=whole_process.ENV).stderr
    seconds = {}
    for line in err.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, name = line[len("import time:"):].split("|")
            name = name.strip()
            # A package whose __init__ is still running when its submodules finish may be listed
            # only through them: the largest cumulative time of the package or any of its modules.
            for package in RUN_PACKAGES:
                if name == package or name.startswith(package + "."):
                    seconds[package] = max(seconds.get(package, 0.0), int(cumulative) / 1e6)
    return seconds


def main() -> None:
    manifest = str(ROOT / "experiments" / "shakespeare-char.toml")
    baseline = timed([sys.executable, "-c", "pass"])
    print(f"python -c pass           {baseline:6.3f} s")
    for argv in (["plugins"], ["check", manifest, "-q"]):
        seconds = timed([sys.executable, "-m", "lmlab", *argv])
        print(f"lmlab {' '.join(argv[:1]):<18} {seconds:6.3f} s  (x{seconds / baseline:.1f} python start-up)"
              f"  heavy modules, plugin packages imported: {imports(argv)}")
    print("\na 20-step run of the quickstart model as a whole process (median of 3):")
    for name, run in (("lmlab run", whole_process.lmlab), ("hand-written", whole_process.handwritten)):
        runs = [run(20) for _ in range(3)]
        median = {f: statistics.median(getattr(r, f) for r in runs) for f in ("wall", "first_step", "after_last")}
        print(f"  {name:13s} wall {median['wall']:6.2f} s | to the first optimizer step {median['first_step']:6.2f} s"
              f" | from the last step to exit {median['after_last']:6.2f} s")
    torch_s, lightning_s = whole_process.import_time("torch"), whole_process.import_time("lightning.pytorch")
    print(f"  python -c 'import torch' {torch_s:.2f} s; 'import lightning.pytorch' {lightning_s:.2f} s "
          f"(Lightning's own share {lightning_s - torch_s:.2f} s)")
    seconds = run_imports()
    print("  imported inside lmlab run (python -X importtime; cumulative, nested packages counted in their "
          "importer too): " + ", ".join(f"{name} {seconds[name]:.2f} s" for name in RUN_PACKAGES if name in seconds)
          + "; not imported: " + (", ".join(name for name in RUN_PACKAGES if name not in seconds) or "none"))


if __name__ == "__main__":
    main()
