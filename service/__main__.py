"""Command line: ``python -m service serve | optimize IN OUT | zoo [--list] [NAME OUT]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _cmd_serve(args: argparse.Namespace) -> int:
    from service.server.main import serve
    from service.settings import SettingsError, load_settings

    given = {"host": args.host, "port": args.port, "model_dir": args.model_dir, "workers": args.workers}
    overrides = {k: v for k, v in given.items() if v is not None}  # port 0 (pick a free one) is a value
    try:
        settings = load_settings(**overrides)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(settings)


def _cmd_optimize(args: argparse.Namespace) -> int:
    import orjson

    from service.errors import ServiceError
    from service.optimizer import OptimizerConfig, optimize
    from service.optimizer.io import save_model_file
    from service.registry.acceptance import accepted_model

    try:
        data = Path(args.input).read_bytes()
    except OSError as exc:
        print(f"error: cannot read {args.input}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        model = accepted_model(data)  # the upload's own check: the CLI refuses what the server would, as it would
        del data
        optimized, report = optimize(model, OptimizerConfig(fused_conv=args.fused_conv, verify=not args.no_verify))
    except ServiceError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    try:
        save_model_file(optimized, Path(args.output))
    except (OSError, ValueError) as exc:  # output not writable; ValueError: protobuf's 2 GiB limit
        print(f"error: cannot write {args.output}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(report.summary())
        print(f"wrote {args.output}")
    return 0


def _cmd_zoo(args: argparse.Namespace) -> int:
    from service import zoo

    if args.list or not args.name:
        for name in zoo.list_models():
            print(name)
        return 0
    if args.name not in zoo.list_models():
        print(f"error: unknown zoo model {args.name!r}; choose one of: {', '.join(zoo.list_models())}", file=sys.stderr)
        return 2
    if not args.output:
        print("error: give an output path: python -m service zoo NAME OUT.onnx", file=sys.stderr)
        return 2
    from service.optimizer.io import save_model_file

    model = zoo.build(args.name, seed=args.seed, opset=args.opset)
    save_model_file(model, Path(args.output))
    print(f"wrote {args.output} ({len(model.graph.node)} nodes)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", help="bind address (default 127.0.0.1, or SERVICE_HOST)")
    serve.add_argument("--port", type=int, help="bind port (default 8000, or SERVICE_PORT)")
    serve.add_argument("--model-dir", help="model repository (default ./models, or SERVICE_MODEL_DIR)")
    serve.add_argument("--workers", type=int, help="server processes sharing the port (default 1, or SERVICE_WORKERS)")
    serve.set_defaults(func=_cmd_serve)

    opt = sub.add_parser("optimize", help="optimize an ONNX model file")
    opt.add_argument("input", help="input .onnx file")
    opt.add_argument("output", help="output .onnx file")
    opt.add_argument("--json", action="store_true", help="print the report as JSON")
    opt.add_argument(
        "--no-fused-conv", dest="fused_conv", action="store_false", help="do not emit com.microsoft.FusedConv"
    )
    opt.add_argument("--no-verify", action="store_true", help="skip the numeric equivalence check (unsafe)")
    opt.set_defaults(func=_cmd_optimize)

    zoo_cmd = sub.add_parser("zoo", help="build a demo/test model (no torch, no download)")
    zoo_cmd.add_argument("name", nargs="?", help="model name (see --list)")
    zoo_cmd.add_argument("output", nargs="?", help="output .onnx file")
    zoo_cmd.add_argument("--list", action="store_true", help="list the available models")
    zoo_cmd.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    zoo_cmd.add_argument("--opset", type=int, default=None, help="opset to write (default: the builder's)")
    zoo_cmd.set_defaults(func=_cmd_zoo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
