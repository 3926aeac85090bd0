"""``lmlab eval RUN_DIR --tasks NAMES``: lm-evaluation-harness tasks scored on a run
(:mod:`lmlab.harness`), the results written into its folder and its ``summary.json``.

``lmlab eval RUN_DIR --data FILE``: held-out exact match of a run on instruction records, or, for an
objective that runs the model itself (reward-model, dpo, ppo), its loss and reported figures.

The records are read by the run's own data plugin (with ``data.path`` pointed at FILE), so the
prompts are formatted by the same template as in training; see :mod:`lmlab.evaluate` and
:mod:`lmlab.objective_eval`.
"""

import json
from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a variant's run folder (holds manifest.toml)")
    parser.add_argument("--tasks", default=None, metavar="NAMES",
                        help="lm-evaluation-harness tasks, comma-separated (lmlab ships shakespeare_next_line, "
                             "shakespeare_ppl, shakespeare_instructions; pip install 'lmlab[eval]')")
    parser.add_argument("--num-fewshot", type=int, default=None, help="examples put before each question (--tasks)")
    parser.add_argument("--include-path", type=Path, default=None, help="a folder of task YAML files of your own")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (--tasks)")
    parser.add_argument("--apply-chat-template", action="store_true",
                        help="put each question through the run's chat template (--tasks)")
    parser.add_argument("--data", type=Path, default=None, help="held-out records, in the run's data format")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N records (of each task)")
    parser.add_argument("--stop", default="\n", help="text that ends an answer (default: a newline)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write every prompt, reference and answer as JSON lines here")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's manifest")


def main(args) -> int:
    from lmlab.evaluate import answer_all, exact_match
    from lmlab.trained import load_run, refuse_bidirectional

    if (args.tasks is None) == (args.data is None):
        raise UserError("give --tasks (lm-evaluation-harness tasks) or --data (held-out records)", key="--tasks")
    if args.limit is not None and args.limit < 1:
        raise UserError("must be positive", key="--limit")
    if args.tasks is not None:
        return harness(args)
    if not args.data.is_file():
        raise UserError("no such file", key=str(args.data))
    if args.stop == "":
        raise UserError("a stop string cannot be empty (it would end every answer before it starts); "
                        "the default is a newline", key="--stop")
    if args.out is not None:
        above = next((p for p in args.out.parents if p.exists()), None)
        if args.out.is_dir():
            raise UserError(f"{args.out} is a folder; name the file to write the answers to", key="--out")
        if above is not None and not above.is_dir():
            raise UserError(f"{above} is a file, so {args.out} cannot be written", key="--out")
    # The run's own data plugin reads the records, pointed at the held-out file: same template.
    overrides = [*args.overrides, f"data.path={json.dumps(str(args.data.resolve()))}"]
    run = load_run(args.run_dir, overrides)
    if run.objective.runs_model():  # a reward model, DPO, PPO: the objective's own held-out figures
        return _objective_scores(run, args)
    refuse_bidirectional(run.objective)
    records = _records(run, args)
    answers = answer_all(run.model, run.tokenizer, records, stop=args.stop)
    score = exact_match(answers)
    if args.out is not None:
        from lmlab.rundir import atomic_write_bytes

        lines = (json.dumps({"prompt": a.prompt, "reference": a.reference, "answer": a.answer,
                             "correct": a.correct}) + "\n" for a in answers)
        atomic_write_bytes(args.out, "".join(lines).encode())
    print(f"exact match {score:.4f} ({sum(a.correct for a in answers)}/{len(answers)}) on {args.data}")
    return 0


def _records(run, args) -> list:
    """The file's records, as the run's data plugin reads them (its conversations written out as
    preparing them did)."""
    from lmlab.api import Conversation, Record
    from lmlab.conversation import conversation_writer

    source = run.variant.instantiate("data")
    records, writer = [], None
    for number, doc in enumerate(source.documents(), 1):
        if isinstance(doc, Conversation):
            writer = writer or conversation_writer(source, run.tokenizer)
            doc = writer.record(doc, f"{args.data}: conversation {number}")
        if not isinstance(doc, Record):
            raise UserError(f"data plugin {run.variant.uses('data')!r} yields plain text, not prompt/response "
                            "records (use e.g. alpaca)", key="data.use")
        records.append(doc)
        if args.limit is not None and len(records) >= args.limit:
            break
    if not records:
        raise UserError("holds no records", key=str(args.data))
    return records


def _objective_scores(run, args) -> int:
    """An objective that runs the model itself, scored on the file as the run's closing evaluation scores
    its validation split: the loss and every figure it reports."""
    from lmlab import objective_eval, objective_runs

    records = _records(run, args)
    device = next(run.model.parameters()).device
    for model in objective_runs.prepare(run.variant, run.objective, run.tokenizer, run.plugins.get("decoding")):
        model.to(device)
    split = objective_eval.record_split(records, run.tokenizer)
    scores = objective_eval.evaluate(run.model, run.objective, split, run.shape.block_size,
                                     run.variant.train.eval_batch_size, run.variant.seed)
    figures = {"val_loss": scores.loss, **{f"val_{k}": v for k, v in scores.figures.items()}}
    if args.out is not None:
        from lmlab.rundir import atomic_write_bytes

        atomic_write_bytes(args.out, (json.dumps({"records": scores.records, **figures}) + "\n").encode())
    shown = " | ".join(f"{k} {v:.4f}" for k, v in figures.items())
    print(f"{run.objective.name} on {scores.records} records of {args.data}: {shown}")
    return 0


def harness(args) -> int:
    """--tasks: lm-eval's tasks on the run, printed as lm-eval prints them and written into the run."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("names no task", key="--tasks")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError("must be 0 or more", key="--num-fewshot")
    if args.batch_size < 1:
        raise UserError("must be positive", key="--batch-size")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("scoring tasks needs lm-evaluation-harness: pip install 'lmlab[eval]'", key="--tasks") from None
    from lmlab.harness import scores
    from lmlab.trained import load_run

    run = load_run(args.run_dir, args.overrides)
    results = scores.evaluate(run, tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                              include_path=args.include_path, batch_size=args.batch_size,
                              chat=args.apply_chat_template)
    path = scores.record(args.run_dir, results, run.plugins.get("tracker"))
    from lm_eval.utils import make_table

    print(make_table(results))
    print(f"results: {path}")
    return 0
