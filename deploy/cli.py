"""The ``tandem`` command: one subcommand per way of running Tandem."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from deploy import bench_cmd, generate_cmd, keygen_cmd, launch_cmd, ray_cmd, serve_cmds, top_cmd
from deploy.parent_guard import die_with_parent_if_asked

# config, checkpoint, request and input errors, and a file the user named that cannot be read or written (exists,
# is a directory, no permission): a message, not a traceback
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default=None, type=_log_level,
                        help="DEBUG, INFO, WARNING (default), ERROR, CRITICAL; tandem up's processes log at this "
                             "level too (default INFO, in their log files)")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.register(sub)
    serve_cmds.register(sub)
    launch_cmd.register(sub)
    bench_cmd.register(sub)
    ray_cmd.register(sub)
    keygen_cmd.register(sub)
    top_cmd.register(sub)
    return parser


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"one of DEBUG, INFO, WARNING, ERROR, CRITICAL (got {text!r})")
    return level


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()  # before anything else: a supervised process must not outlive its supervisor
    args = build_parser().parse_args(argv)
    if args.log_level is not None:  # the processes a launcher starts log at the level asked for too
        from deploy.local_spawner import CHILD_LOG_LEVEL_ENV

        os.environ[CHILD_LOG_LEVEL_ENV] = args.log_level
    logging.basicConfig(level=args.log_level or "WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpcore"):  # a launcher's readiness polls, a request per line at DEBUG
        logging.getLogger(chatty).setLevel(max(logging.getLogger().level, logging.INFO))
    try:
        return int(args.handler(args) or 0)
    except USER_ERRORS as exc:
        command = " ".join(filter(None, (args.command, getattr(args, "ray_command", None))))  # "ray up"
        print(f"tandem {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
