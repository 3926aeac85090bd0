"""``lmlab schema [--out FILE]``: the JSON Schema of manifests, with every installed plugin's options.

Imports every installed plugin (their Options make the schema), but never lightning, wandb,
deepspeed or peft: plugins import those where they use them, not at the top.
"""

from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("--out", metavar="FILE", help="write the schema to FILE instead of printing it")


def main(args) -> int:
    import json
    import sys

    from lmlab.schema import manifest_schema

    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        raise UserError("no such folder to write the schema into", key=str(out.parent))
    if out is not None and out.is_dir():
        raise UserError("is a folder; give a file name", key=str(out))
    text = json.dumps(manifest_schema(), indent=2, ensure_ascii=False) + "\n"
    if out is None:
        sys.stdout.write(text)
        return 0
    from lmlab.rundir import atomic_write_bytes

    atomic_write_bytes(out, text.encode("utf-8"))
    print(f"wrote {out}", file=sys.stderr)
    return 0
