"""``lmlab serve RUN_DIR``: an OpenAI-compatible HTTP endpoint over a trained run (``lmlab.serve``)."""

import os
from pathlib import Path

from lmlab.errors import UserError

API_KEY_ENV = "LMLAB_API_KEY"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a variant's run folder (holds manifest.toml)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one, printed)")
    parser.add_argument("--max-batch", type=int, default=32,
                        help="sequences decoded together; more requests wait for a free row")
    parser.add_argument("--cache", choices=("contiguous", "paged"), default=None,
                        help="the key/value cache shared by the running requests (default: paged, or "
                             "--set decoding.cache)")
    parser.add_argument("--model-name", default=None, help="the model id clients name (default: the run folder's name)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every request (default: ${API_KEY_ENV}, "
                             "which keeps the key out of the process list and shell history)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's manifest, e.g. --set decoding.use=sample "
                             "--set decoding.temperature=0.7 (the defaults of requests' fields)")


def main(args) -> int:
    if args.max_batch < 1:
        raise UserError("must be positive", key="--max-batch")
    if not 0 <= args.port < 65536:
        raise UserError("must be a port number, 0 to 65535", key="--port")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and (not api_key.isascii() or not api_key.isprintable() or not api_key
                                or any(c.isspace() for c in api_key)):
        # A header cannot carry it as given (and an empty key would guard nothing).
        raise UserError("must be a non-empty key of printable ASCII characters without spaces",
                        key="--api-key" if args.api_key is not None else API_KEY_ENV)
    from lmlab.serve.app import serve

    return serve(args.run_dir, host=args.host, port=args.port, max_batch=args.max_batch, cache=args.cache,
                 model_name=args.model_name, overrides=args.overrides, api_key=api_key)
