"""``lmlab serve RUN_DIR``: an OpenAI-compatible HTTP endpoint over a trained run (``lmlab.serve``)."""

from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a variant's run folder (holds manifest.toml)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one, printed)")
    parser.add_argument("--max-batch", type=int, default=32,
                        help="sequences decoded together; more requests wait for a free row")
    parser.add_argument("--cache", choices=("contiguous", "paged"), default="paged",
                        help="the key/value cache shared by the running requests (default: paged)")
    parser.add_argument("--model-name", default=None, help="the model id clients name (default: the run folder's name)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's manifest")


def main(args) -> int:
    if args.max_batch < 1:
        raise UserError("must be positive", key="--max-batch")
    if not 0 <= args.port < 65536:
        raise UserError("must be a port number, 0 to 65535", key="--port")
    from lmlab.serve.app import serve

    return serve(args.run_dir, host=args.host, port=args.port, max_batch=args.max_batch, cache=args.cache,
                 model_name=args.model_name, overrides=args.overrides)
