"""Entry point: parses the verb and hands over to its module.

Kept free of heavy imports (torch, lightning, pydantic): ``lmlab plugins`` must answer at once.
Exit status: 0 success, 2 bad input (a UserError, one line, no traceback), 1 anything else; 130
after Ctrl-C and 143 after SIGTERM (a run resumes when the command is run again).
"""

import argparse
import importlib
import sys

from lmlab import signals
from lmlab.errors import UserError

VERBS = {
    "run": "trains every variant of a manifest",
    "check": "validates a manifest and prints its resolved variants; runs nothing",
    "plugins": "lists installed plugins per slot, and known ones that are not installed",
    "compare": "tabulates the variants of a runs folder (seeds pooled, tested against a baseline), with plots",
    "generate": "generates text from a trained run, streamed; --prompts FILE for a batch",
    "serve": "serves a trained run over an OpenAI-compatible HTTP API (completions, chat, streaming)",
    "doctor": "prints a run's failure diagnosis (cause, evidence, fixes) and its health from what it recorded",
    "merge": "folds a PEFT run's adapter into its base weights and writes a plain model",
    "export": "writes a trained run as a Hugging Face folder that transformers loads",
    "eval": "scores a trained run's greedy answers to held-out instruction records (exact match)",
    "rerun": "trains a run again from its recorded manifest and says where the environment differs",
    "new-plugin": "scaffolds a third-party plugin distribution (code, tests, README, example manifest)",
    "schema": "prints the JSON Schema of manifests, with the options of every installed plugin",
    "plan": "prints memory per device and communication per step of each variant, before running it",
    "prepare": "filters and tokenises each variant's data into sharded token files in the cache",
    "compress": "writes a smaller or faster copy of a trained run (quantised, pruned) as a new run folder",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit status is 2 too; keep its usage line
        self.print_usage(sys.stderr)
        raise UserError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lmlab", description="A plugin-based workbench for language-model experiments.")
    from lmlab import __version__

    parser.add_argument("--version", action="version", version=f"lmlab {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    for verb, help_text in VERBS.items():
        sub = verbs.add_parser(verb, help=help_text, description=help_text)
        _module(verb).add_arguments(sub)
    return parser


def _module(verb: str):
    return importlib.import_module(f"lmlab.cli.{verb.replace('-', '_')}")


def main(argv: list[str] | None = None) -> int:
    signals.install()
    try:
        args = build_parser().parse_args(argv)
        return _module(args.verb).main(args) or 0
    except UserError as exc:
        print(f"lmlab: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmlab: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except signals.Terminated:
        print("lmlab: terminated (SIGTERM)", file=sys.stderr)
        return signals.EXIT_STATUS
    except BrokenPipeError:
        return 0


def _one_line(message: str) -> str:
    # A value quoted from the user's input (a file name, a TOML string) may hold line breaks.
    return " ".join(message.split("\n"))
