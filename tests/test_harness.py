"""``lmlab eval RUN --tasks``: lm-evaluation-harness's tasks scored on a run through lmlab's own model
class give the numbers lm-eval's ``hf`` model gives on the run exported as a Hugging Face folder
(accuracies and exact matches equal, every log-likelihood within 1e-4); the shipped tasks load without
a network and come from scripts/make_harness_tasks.py byte for byte; the results land in the run
folder and summary.json; bad input is one line and exit 2."""

import gzip
import importlib.util
import json
import shutil

import pytest

from conftest import CORPUS, tiny_toml
from lmlab.cli.main import main
from support import hf_folder, refused, run_cli
from test_chat_data import CHATML
from test_export import FINE_TUNE as EXPORT_FINE_TUNE

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

TASKS = ["shakespeare_next_line", "shakespeare_ppl", "shakespeare_instructions"]
# test_export's fine-tune of a tiny Llama folder, with the window its config allows (a chat question
# with the task's 24 answer tokens needs more than 64).
FINE_TUNE = EXPORT_FINE_TUNE.replace("block_size = 32", "block_size = 128")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A Llama-shaped run fine-tuned from a Hugging Face folder whose tokenizer has ChatML's template, and
    the folder `lmlab export` makes of it."""
    root = tmp_path_factory.mktemp("harness")
    text = CORPUS.read_text()[:30_000]
    (root / "tiny.txt").write_text(text)
    folder, _ = hf_folder(root, text, chat_template=CHATML, positions=128)
    (root / "ft.toml").write_text(FINE_TUNE.format(init=folder, data=root / "tiny.txt"))
    assert main(["run", str(root / "ft.toml"), "--out", str(root / "runs")]) == 0
    run_dir = root / "runs" / "default"
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(root / "hf")]) == 0
    return run_dir, root / "hf"


def test_lmlab_eval_scores_as_lm_evals_hf_model_does_on_the_exported_folder(exported, capsys):
    from lm_eval.models.huggingface import HFLM

    from lmlab.harness import scores

    run_dir, folder = exported
    assert main(["eval", str(run_dir), "--tasks", ",".join(TASKS), "--limit", "12", "--batch-size", "5"]) == 0
    out = capsys.readouterr().out
    assert "shakespeare_next_line" in out and "results:" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    ours = summary["eval"]
    assert set(ours) == set(TASKS) and 0 <= ours["shakespeare_next_line"]["acc"] <= 1
    assert ours["shakespeare_ppl"]["word_perplexity"] > 1 and "exact_match" in ours["shakespeare_instructions"]
    (written,) = (run_dir / "eval").glob("harness-*.json")
    assert json.loads(written.read_text())["versions"]["shakespeare_next_line"] == 1.0

    hf = HFLM(pretrained=str(folder), device="cpu", batch_size=5, dtype="float32")
    theirs = lm_eval.simple_evaluate(model=hf, tasks=TASKS, limit=12, task_manager=scores.task_manager(tasks=TASKS),
                                     log_samples=True, bootstrap_iters=0)
    for task in TASKS:
        for metric, value in ours[task].items():
            assert theirs["results"][task][f"{metric},none"] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, metric)
    mine = [json.loads(line) for line in (run_dir / "eval" / "samples-shakespeare_next_line.jsonl").open()]
    assert len(mine) == 12
    for a, b in zip(mine, theirs["samples"]["shakespeare_next_line"]):  # each choice's log-likelihood
        assert a["doc_id"] == b["doc_id"] and len(a["resps"]) == 4
        for ours_, theirs_ in zip(a["resps"], b["resps"]):
            assert float(ours_[0][0]) == pytest.approx(float(theirs_[0][0]), abs=1e-4)


def test_the_shipped_tasks_are_what_the_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_harness_tasks", CORPUS.parent.parent / "scripts" /
                                                  "make_harness_tasks.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path)])
    for path in sorted(tmp_path.glob("*.jsonl.gz")):
        assert path.read_bytes() == (script.OUT / path.name).read_bytes(), path.name
    rows = [json.loads(line) for line in gzip.open(script.OUT / "shakespeare_next_line.jsonl.gz", "rt")]
    assert len(rows) == 200 and all(len(r["choices"]) == 4 and 0 <= r["gold"] < 4 for r in rows)


def test_bad_input_is_one_line_and_exit_2(exported, tmp_path):
    run_dir, _ = exported
    assert "--tasks" in refused(run_cli("eval", str(run_dir), "--tasks", "no_such_task"), "--tasks")
    refused(run_cli("eval", str(run_dir), "--tasks", "shakespeare_ppl", "--num-fewshot", "-1"), "--num-fewshot")
    own = tmp_path / "tasks"
    own.mkdir()
    (own / "missing.yaml").write_text("task: my_missing\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                      f"    test: {tmp_path / 'nothing.jsonl'}\noutput_type: loglikelihood_rolling\n"
                                      "test_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n")
    line = refused(run_cli("eval", str(run_dir), "--tasks", "my_missing", "--include-path", str(own)), "--tasks")
    assert "nothing.jsonl" in line


def test_an_encoder_only_run_is_refused_naming_its_objective(tmp_path):
    (tmp_path / "tiny.txt").write_text(CORPUS.read_text()[:20_000])
    (tmp_path / "mlm.toml").write_text(tiny_toml("tiny.txt", steps=2, eval_every=2, checkpoint_every=2,
                                                 sample_tokens=0) + '\n[objective]\nuse = "mlm"\n')
    assert main(["run", str(tmp_path / "mlm.toml"), "--out", str(tmp_path / "runs")]) == 0
    refused(run_cli("eval", str(tmp_path / "runs" / "default"), "--tasks", "shakespeare_instructions"), "objective.use")
    shutil.rmtree(tmp_path / "runs")


def test_a_lora_run_scores_as_lm_evals_hf_model_with_the_exported_adapter(exported, tmp_path):
    """A PEFT run is scored with its adapter: as lm-eval's hf model scores the base with `peft=`."""
    from lm_eval.models.huggingface import HFLM

    from lmlab.harness import scores
    from lmlab.trained import load_run

    run_dir, _ = exported
    init = run_dir.parent.parent / "hf-llama"
    (tmp_path / "lora.toml").write_text(FINE_TUNE.format(init=init, data=run_dir.parent.parent / "tiny.txt")
                                        + '[peft]\nuse = "lora"\ntargets = ["q", "v"]\n[optimizer]\nuse = "adamw"\n'
                                          'lr = 0.05\n')
    assert main(["run", str(tmp_path / "lora.toml"), "--out", str(tmp_path / "runs")]) == 0
    lora = tmp_path / "runs" / "default"
    assert main(["export", str(lora), "--format", "peft", "--out", str(tmp_path / "adapter")]) == 0
    tasks = ["shakespeare_next_line", "shakespeare_ppl"]
    ours = scores.evaluate(load_run(lora), tasks, limit=8)
    hf = HFLM(pretrained=str(init), peft=str(tmp_path / "adapter"), device="cpu", batch_size=8, dtype="float32")
    theirs = lm_eval.simple_evaluate(model=hf, tasks=tasks, limit=8, task_manager=scores.task_manager(tasks=tasks),
                                     bootstrap_iters=0)
    for task in tasks:
        for key, value in ours["results"][task].items():
            if isinstance(value, float):
                assert theirs["results"][task][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, key)


def test_the_scores_reach_the_runs_wandb_record(tmp_path):
    pytest.importorskip("wandb")
    # In subprocesses: W&B started in this process would leave its service's address in the environment,
    # and every later `lmlab run` child would share that service (a killed run's id held there for good).
    env = {"WANDB_MODE": "offline", "LMLAB_CACHE": str(tmp_path / "cache")}
    (tmp_path / "tiny.txt").write_text(CORPUS.read_text()[:20_000])
    manifest = tiny_toml("tiny.txt", steps=2, eval_every=2, checkpoint_every=2, sample_tokens=0)
    (tmp_path / "w.toml").write_text(manifest.replace('[tracker]\nuse = "none"', '[tracker]\nuse = "wandb"'))
    assert run_cli("run", str(tmp_path / "w.toml"), "--out", str(tmp_path / "runs"), env=env).returncode == 0
    run_dir = tmp_path / "runs" / "default"
    done = run_cli("eval", str(run_dir), "--tasks", "shakespeare_next_line", "--limit", "4",
                   "--set", "tokenizer.unknown=skip", env=env)  # a character 20 kB of text never showed
    assert done.returncode == 0, done.stderr[-2000:]
    acc = json.loads((run_dir / "summary.json").read_text())["eval"]["shakespeare_next_line"]["acc"]
    # The run reopened offline under its id (a second offline folder, which `wandb sync` merges into the
    # run), its summary record holding each score as key and JSON value.
    first, again = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert first.name == again.name  # one run id
    record = again.read_bytes()
    assert b"eval/shakespeare_next_line/acc" in record and json.dumps(acc).encode() in record
    assert b"eval/shakespeare_next_line" not in first.read_bytes()


def test_a_sweeps_variants_are_compared_on_a_task_score(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text(CORPUS.read_text()[:60_000])
    (tmp_path / "s.toml").write_text(tiny_toml("tiny.txt", steps=4, eval_every=4, checkpoint_every=4, sample_tokens=0)
                                     + '\n[sweep]\n"attention.use" = ["mha", "mqa"]\nseeds = [1, 2]\n')
    assert main(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "runs")]) == 0
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if (p / "summary.json").is_file())
    assert len(runs) == 4
    for run_dir in runs:
        assert main(["eval", str(run_dir), "--tasks", "shakespeare_ppl", "--limit", "3",
                     "--set", "tokenizer.unknown=skip"]) == 0
    capsys.readouterr()
    html = tmp_path / "report.html"
    assert main(["compare", str(tmp_path / "runs"), "--metric", "shakespeare_ppl/bits_per_byte",
                 "--html", str(html)]) == 0
    table = capsys.readouterr().out
    assert "attention.use=mha" in table and "attention.use=mqa" in table and "baseline" in table
    assert "lower is better" in html.read_text() and "shakespeare_ppl/bits_per_byte" in html.read_text()
    assert main(["compare", str(tmp_path / "runs"), "--metric", "shakespeare_ppl/nothing"]) == 2
    assert "shakespeare_ppl/bits_per_byte" in capsys.readouterr().err  # the metrics the runs report


def test_a_manifests_eval_table_scores_each_variant_at_its_end(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text(CORPUS.read_text()[:60_000])
    base = tiny_toml("tiny.txt", steps=2, eval_every=2, checkpoint_every=2, sample_tokens=0)
    (tmp_path / "e.toml").write_text(base + '\n[tokenizer]\nuse = "char"\nunknown = "skip"\n\n'
                                     '[eval]\ntasks = ["shakespeare_ppl"]\nlimit = 2\n')
    assert main(["check", str(tmp_path / "e.toml")]) == 0
    assert main(["run", str(tmp_path / "e.toml"), "--out", str(tmp_path / "runs")]) == 0
    run_dir = tmp_path / "runs" / "default"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["eval"]["shakespeare_ppl"]["bits_per_byte"] > 0
    assert "[eval]" in (run_dir / "manifest.toml").read_text()
    # An unknown task is refused before anything trains.
    (tmp_path / "bad.toml").write_text(base + '\n[eval]\ntasks = ["no_such_task"]\n')
    result = run_cli("run", str(tmp_path / "bad.toml"), "--out", str(tmp_path / "bad"))
    refused(result, "eval.tasks")
    assert not (tmp_path / "bad" / "default" / "checkpoints").exists()


def test_lm_evals_local_completions_against_lmlab_serve_scores_as_lmlab_eval(exported):
    """The third way: lm-eval's OpenAI-compatible client scoring through `lmlab serve` (echo, logprobs,
    token-id prompts, several prompts a request) gives lmlab eval's numbers."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from lmlab import discovery
    from lmlab.harness import scores
    from lmlab.serve.service import Service
    from lmlab.trained import load_run
    from support import serving

    run_dir, folder = exported
    run = load_run(run_dir)
    tasks = ["shakespeare_next_line", "shakespeare_ppl"]
    # lm-eval's API models keep one token of max_length for the answer and one more for rolling windows.
    ours = scores.evaluate(run, tasks, limit=6, max_length=62)
    service = Service(run.model, run.tokenizer, decoder=discovery.load("decoding", "greedy")(), model_id="ft",
                      data_name="text-file")
    with serving(service) as url:
        api = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model="ft", tokenizer_backend="huggingface",
                                  tokenizer=str(folder), max_length=64, batch_size=4, tokenized_requests=True)
        theirs = lm_eval.simple_evaluate(model=api, tasks=tasks, limit=6, task_manager=scores.task_manager(tasks=tasks),
                                         log_samples=True, bootstrap_iters=0)
    for task in tasks:
        for key, value in ours["results"][task].items():
            if isinstance(value, float):
                assert theirs["results"][task][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, key)
    for a, b in zip(ours["samples"]["shakespeare_next_line"], theirs["samples"]["shakespeare_next_line"]):
        for x, y in zip(a["resps"], b["resps"]):
            assert float(x[0][0]) == pytest.approx(float(y[0][0]), abs=1e-4)


def test_lm_evals_local_chat_completions_against_lmlab_serve_answers_as_lmlab_eval(exported):
    """lm-eval's chat client sends each question as messages to `lmlab serve`'s chat route, which puts
    them through the run's template and decodes greedily (temperature 0) up to the task's stop: the
    answers are the ones `lmlab eval --apply-chat-template` gives."""
    from lm_eval.models.openai_completions import LocalChatCompletion

    from lmlab.harness import scores
    from lmlab.serve.service import Service
    from lmlab.trained import load_run
    from support import serving

    run_dir, _ = exported
    task = "shakespeare_instructions"
    ours = scores.evaluate(load_run(run_dir), [task], limit=8, chat=True)
    with serving(Service.from_run(run_dir, model_name="ft")) as url:
        api = LocalChatCompletion(base_url=f"{url}/v1/chat/completions", model="ft", max_length=128)
        theirs = lm_eval.simple_evaluate(model=api, tasks=[task], limit=8,
                                         task_manager=scores.task_manager(tasks=[task]),
                                         apply_chat_template=True, log_samples=True, bootstrap_iters=0)
    ours_, theirs_ = ours["samples"][task], theirs["samples"][task]
    assert ours_[0]["arguments"][0][0] != theirs_[0]["arguments"][0][0]  # rendered text against messages
    assert [s["resps"] for s in ours_] == [s["resps"] for s in theirs_]
    assert any(s["resps"][0][0] for s in ours_)  # the answers are not all empty
    assert theirs["results"][task]["exact_match,none"] == ours["results"][task]["exact_match,none"]
