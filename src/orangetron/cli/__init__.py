"""The `orangetron` command: one subcommand per job, each defined beside the code it drives."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from orangetron.cli.plan import add_plan_commands
    from orangetron.train.commands import add_train_commands
    from orangetron.train.export import add_export_command
    from orangetron.train.sample import add_sample_command

    parser = argparse.ArgumentParser(
        prog="orangetron",
        description="Train and plan long-context and MoE transformers with TP, CP, EP, DP and PP.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_commands(sub)
    add_export_command(sub)
    add_sample_command(sub)
    add_plan_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Bad input prints one line on standard error and returns 2, never a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):
            args = _with_config_file(parser, args, argv)
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"orangetron {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"orangetron {args.command}: interrupted", file=sys.stderr)
        return 130


def _with_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse again with the file's options as defaults, so that flags on the command line override them."""
    from orangetron.train.config_file import read_config_file

    args.command_parser.set_defaults(**read_config_file(args.config, args.command_parser))
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
