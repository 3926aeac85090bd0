"""``lmlab eval RUN_DIR --data FILE``: held-out exact match of a run on instruction records.

The records are read by the run's own data plugin (with ``data.path`` pointed at FILE), so the
prompts are formatted by the same template as in training; see :mod:`lmlab.evaluate`.
"""

import json
from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a variant's run folder (holds manifest.toml)")
    parser.add_argument("--data", type=Path, required=True, help="held-out records, in the run's data format")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N records")
    parser.add_argument("--stop", default="\n", help="text that ends an answer (default: a newline)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write every prompt, reference and answer as JSON lines here")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's manifest")


def main(args) -> int:
    from lmlab.api import Record
    from lmlab.evaluate import answer_all, exact_match
    from lmlab.trained import load_run, refuse_bidirectional

    if not args.data.is_file():
        raise UserError("no such file", key=str(args.data))
    if args.limit is not None and args.limit < 1:
        raise UserError("must be positive", key="--limit")
    # The run's own data plugin reads the records, pointed at the held-out file: same template.
    overrides = [*args.overrides, f"data.path={json.dumps(str(args.data.resolve()))}"]
    run = load_run(args.run_dir, overrides)
    refuse_bidirectional(run.objective)
    records = []
    for doc in run.variant.instantiate("data").documents():
        if not isinstance(doc, Record):
            raise UserError(f"data plugin {run.variant.manifest['data']['use']!r} yields plain text, not "
                            "prompt/response records (use e.g. alpaca)", key="data.use")
        records.append(doc)
        if args.limit is not None and len(records) >= args.limit:
            break
    if not records:
        raise UserError("holds no records", key=str(args.data))
    answers = answer_all(run.model, run.tokenizer, records, stop=args.stop)
    score = exact_match(answers)
    if args.out is not None:
        from lmlab.rundir import atomic_write_bytes

        lines = (json.dumps({"prompt": a.prompt, "reference": a.reference, "answer": a.answer,
                             "correct": a.correct}) + "\n" for a in answers)
        atomic_write_bytes(args.out, "".join(lines).encode())
    print(f"exact match {score:.4f} ({sum(a.correct for a in answers)}/{len(answers)}) on {args.data}")
    return 0
