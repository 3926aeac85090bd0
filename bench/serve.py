"""`lmlab serve` under load: N concurrent completion requests against the same N sent one at a time.

Starts ``lmlab serve RUN_DIR --port 0`` in a subprocess, as a user would, and waits for ``/health``.
Then N completion requests (different prompts: the first lines of tinyshakespeare, temperature 0,
``--max-tokens`` new tokens each, no stop) go first one at a time, then all at once from N client
threads. Printed: the new tokens per second of both, their ratio (what continuous batching buys), and
whether every request got the same text both ways (it must: greedy decoding of a row does not
depend on the rows beside it).

    python bench/serve.py [RUN_DIR] [--requests 16] [--max-tokens 64] [--max-batch 16] [--cache paged]

RUN_DIR defaults to the 8-layer target of experiments/decoding.toml (``lmlab run
experiments/decoding.toml``); any run folder whose tokenizer can encode Shakespeare's text works.
"""

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUN = ROOT / "runs" / "decoding" / "model.n_layers=8"


def prompts(n: int) -> list[str]:
    """n different opening lines of tinyshakespeare (a speaker's name and the start of the speech)."""
    lines = [line for line in (ROOT / "data" / "tinyshakespeare.txt").read_text().splitlines() if line.strip()]
    chosen = []
    for i in range(len(lines) - 1):
        if lines[i].endswith(":") and len(lines[i + 1]) > 16:
            text = f"{lines[i]}\n{lines[i + 1][:16]}"
            if text not in chosen:
                chosen.append(text)
        if len(chosen) == n:
            return chosen
    raise SystemExit(f"fewer than {n} prompts in tinyshakespeare")


def start(run_dir: Path, max_batch: int, cache: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "lmlab", "serve", str(run_dir), "--port", "0", "--max-batch", str(max_batch),
           "--cache", cache, "--set", "decoding.use=greedy"]  # the server's decoder: requests set nothing
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        print(line.rstrip(), flush=True)
        if "http://" in line:
            base = line.split()[2].removesuffix("/v1")
            break
    else:
        raise SystemExit(f"lmlab serve ended (exit {proc.wait()}) before printing its URL")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("the server did not answer /health within 120 s")


def complete(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, nargs="?", default=DEFAULT_RUN)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--cache", choices=("paged", "contiguous"), default="paged")
    args = parser.parse_args()
    if not (args.run_dir / "manifest.toml").is_file():
        raise SystemExit(f"{args.run_dir} is not a run folder; train one (lmlab run experiments/decoding.toml) "
                         "or pass a run folder")
    texts = prompts(args.requests)
    proc, base = start(args.run_dir, args.max_batch, args.cache)
    try:
        with httpx.Client(base_url=base, timeout=600) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            complete(http, model, texts[0], 8)  # warm-up
            began = time.perf_counter()
            alone = [complete(http, model, p, args.max_tokens) for p in texts]
            one_at_a_time = time.perf_counter() - began

        together: list = [None] * len(texts)
        barrier = threading.Barrier(len(texts) + 1)

        def ask(i: int) -> None:
            with httpx.Client(base_url=base, timeout=600) as own:
                barrier.wait()
                together[i] = complete(own, model, texts[i], args.max_tokens)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        barrier.wait()
        began = time.perf_counter()
        for t in threads:
            t.join()
        concurrent = time.perf_counter() - began
    finally:
        proc.terminate()
        proc.wait(30)

    made_alone = sum(n for _, n in alone)
    made_together = sum(n for _, n in together)
    seq_rate, conc_rate = made_alone / one_at_a_time, made_together / concurrent
    print(f"\n{args.requests} requests x {args.max_tokens} new tokens, temperature 0, max batch {args.max_batch}, "
          f"{args.cache} cache, run {args.run_dir}")
    print(f"one at a time   {made_alone:6d} tokens in {one_at_a_time:7.2f} s  {seq_rate:9,.0f} tokens/s")
    print(f"all at once     {made_together:6d} tokens in {concurrent:7.2f} s  {conc_rate:9,.0f} tokens/s")
    print(f"ratio           {conc_rate / seq_rate:.2f}x")
    same = sum(a[0] == b[0] for a, b in zip(alone, together))
    print(f"same text both ways: {same}/{len(texts)}")


if __name__ == "__main__":
    main()
