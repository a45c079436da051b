"""The ``tandem`` command: one subcommand per way of running Tandem."""

from __future__ import annotations

import argparse
import logging
import sys

from deploy import bench_cmd, generate_cmd, keygen_cmd, launch_cmd, ray_cmd, serve_cmds, top_cmd
from deploy.parent_guard import die_with_parent_if_asked

# config, checkpoint, request and input errors, and a file the user named that cannot be read or written (exists,
# is a directory, no permission): a message, not a traceback
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.register(sub)
    serve_cmds.register(sub)
    launch_cmd.register(sub)
    bench_cmd.register(sub)
    ray_cmd.register(sub)
    keygen_cmd.register(sub)
    top_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()  # before anything else: a supervised process must not outlive its supervisor
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except USER_ERRORS as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
