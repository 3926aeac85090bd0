"""CLI start-up: how long `lmlab plugins` and `lmlab check` take, and what they import.

`lmlab plugins` must answer in under 0.5 s with every first-party plugin installed (it reads
entry-point metadata only); `lmlab check` imports the plugins its manifest names, and never
lightning, wandb, deepspeed or peft. Each command runs 5 times in a fresh interpreter; the median
is printed next to a bare `python -c pass` baseline measured the same way.

    python bench/startup.py
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def main() -> None:
    manifest = str(ROOT / "experiments" / "shakespeare-char.toml")
    baseline = timed([sys.executable, "-c", "pass"])
    print(f"python -c pass           {baseline:6.3f} s")
    for argv in (["plugins"], ["check", manifest, "-q"]):
        seconds = timed([sys.executable, "-m", "lmlab", *argv])
        print(f"lmlab {' '.join(argv[:1]):<18} {seconds:6.3f} s  (x{seconds / baseline:.1f} python start-up)"
              f"  heavy modules, plugin packages imported: {imports(argv)}")


if __name__ == "__main__":
    main()
