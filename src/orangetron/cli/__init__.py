"""The `orangetron` command: one subcommand per job, each defined beside the code it drives."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from orangetron import __version__
from orangetron.cli.wording import flag_named, flags_of, set_by_file, typed_flags


class _OneLineErrors(argparse.ArgumentParser):
    """Bad flags (an unknown one, a value of the wrong type or outside its choices) are reported like every other
    bad input: one line on standard error, exit status 2, not the usage block first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefixes of flags: `prepare-data --ov` was taken for --overwrite and moved a dataset aside. A
        # command's own parsers are made of this class too (argparse builds subparsers of the parent's type).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):  # argparse says so before unknown flags
            message += _unknown_flags(self, getattr(self, "given", []))  # `--micro-batches 4` for --microbatches
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        """Also name, as `own_parser`, the innermost (sub)command's parser: errors found after parsing are
        worded with its name ("orangetron tokenizer train") and point to its --help."""
        self.given = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        if getattr(namespace, "own_parser", None) is None:  # a subcommand's parser finishes first
            namespace.own_parser = self
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    from orangetron.cli.plan import add_plan_commands
    from orangetron.train.commands import add_train_commands
    from orangetron.train.export import add_export_command
    from orangetron.train.prepare import add_data_commands
    from orangetron.train.sample import add_sample_command

    parser = _OneLineErrors(
        prog="orangetron",
        description="Train and plan long-context and MoE transformers with TP, CP, EP, DP and PP.",
    )
    parser.add_argument("--version", action="version", version=f"orangetron {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_commands(sub)
    add_export_command(sub)
    add_sample_command(sub)
    add_data_commands(sub)
    add_plan_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Bad input prints one line on standard error and returns 2, never a traceback."""
    try:
        parser = build_parser()  # its choices name the registered variants: plugins load here
    except ValueError as err:
        print(f"orangetron: error: {err}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the command that was given them, whose --help lists its flags
        owner = _owner(parser, args, sys.argv[1:] if argv is None else list(argv), unknown)
        owner.error(f"unrecognized arguments: {' '.join(unknown)}{_near_flags(owner, unknown)}")
    try:
        args.data_given = getattr(args, "data", None) is not None  # on the command line, before any file
        args.typed = set(typed_flags(args.own_parser).values())
        takes_files = hasattr(args, "command_parser")  # train and verify; estimate reads its --config itself
        if takes_files and (getattr(args, "config", None) or getattr(args, "resume", False)):
            args = _with_config_file(parser, args, argv)
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        if isinstance(err, ValueError):  # a rule names the option's field: say which flag sets it
            message = flag_named(str(err), flags_of(args.own_parser))
            for source, fields in _option_files(args):  # --config first: its values override the record's
                message = set_by_file(message, flags_of(args.own_parser), args.typed, source, fields)
        print(f"{args.own_parser.prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{args.own_parser.prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (`| head`) left: what it did not read is not an error to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 141


def _resumed_run(prog: str, config: str, recorded: str | None) -> dict[str, str]:
    """`--config DIR/config.toml --resume` resumes the run in DIR (`run_folder.record_folder`), wherever the
    record says it ran: a run moved, or moved aside by `--overwrite`, left its old `out` in its record, and a
    resume continued the run found there. A file that is no run's record keeps its own `out`."""
    from orangetron.train.run_folder import record_folder

    folder = record_folder(config)
    if folder is None:
        return {}
    if recorded is not None and Path(recorded).resolve() != folder:
        print(f"{prog}: note: --config {config} --resume continues the run in {folder}; its record names "
              f"out={recorded}, where it ran before it moved", file=sys.stderr)
    return {"out": str(folder)}


def _option_files(args: argparse.Namespace) -> list[tuple[str, set[str]]]:
    """The files that gave this command options, as a message names each, with the fields each gave: a --config
    file, then a resumed run's record."""
    from orangetron.train.run_folder import CONFIG_FILE

    config, out = getattr(args, "config", None), getattr(args, "out", None)
    files = [(f"--config {config}", _file_fields(config))] if config else []
    record = Path(out, CONFIG_FILE) if getattr(args, "resume", False) and out is not None else None
    if record is not None and record.is_file():
        files.append((f"the run's record {record}", _file_fields(str(record))))
    return files


def _file_fields(config: str | None) -> set[str]:
    """The fields a --config file gives (none when there is no file, or it cannot be read: its own error says
    so)."""
    from orangetron.train.config_file import read_toml

    try:
        return {key.replace("-", "_") for key in read_toml(config)} if config else set()
    except (OSError, ValueError):
        return set()


def _owner(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str],
           unknown: list[str]) -> argparse.ArgumentParser:
    """The parser that was given `unknown`: `orangetron` itself for a flag before the command's name
    (`orangetron --bogus train`), else the innermost command's."""
    command = argv.index(args.command) if args.command in argv else len(argv)
    return parser if any(arg in argv[:command] for arg in unknown) else args.own_parser


def _unknown_flags(parser: argparse.ArgumentParser, given: list[str]) -> str:
    """"; unrecognized arguments: --micro-batches; did you mean --microbatches?" for the flags in `given` that
    `parser` does not take, or "" when it takes them all."""
    flags = {flag for action in parser._actions for flag in action.option_strings}
    unknown = [arg for arg in given if arg.startswith("--") and arg != "--" and arg.split("=")[0] not in flags]
    return f"; unrecognized arguments: {' '.join(unknown)}{_near_flags(parser, unknown)}" if unknown else ""


# The same quantity under the trainer's name and the planner's: a flag of one given to the other's command.
_OTHER_NAMES = {"--seq-len": "--seq", "--batch-size": "--global-batch", "--seq": "--seq-len",
                "--global-batch": "--batch-size"}


def _near_flags(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """"; did you mean --steps?" for each unknown flag with a close spelling among `parser`'s (`--stpes 3`), or
    its name on this command (`estimate --seq-len` is `--seq`)."""
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    near = {}
    for given in (arg.split("=")[0] for arg in unknown if arg.startswith("--")):
        close = [_OTHER_NAMES[given]] if _OTHER_NAMES.get(given) in flags else \
            difflib.get_close_matches(given, flags, n=1, cutoff=0.75)
        if close:
            near[given] = close[0]
    if len(near) == 1:
        return f"; did you mean {next(iter(near.values()))}?"
    return f"; did you mean: {', '.join(f'{given} -> {flag}' for given, flag in near.items())}?" if near else ""


def _with_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse again with the files' options as defaults, so that flags on the command line override them: a
    resumed run's record first (all but its directives, `run_folder.DIRECTIVES`), then `--config`."""
    from orangetron.train.config_file import read_config_file, read_toml
    from orangetron.train.run_folder import CONFIG_FILE, DIRECTIVES

    defaults = {}
    out = getattr(args, "out", None)
    if getattr(args, "resume", False) and out is not None and Path(out, CONFIG_FILE).is_file():
        record = Path(out, CONFIG_FILE)
        defaults = read_config_file(str(record), args.command_parser)
        defaults = {k: v for k, v in defaults.items() if k not in DIRECTIVES}
        if hasattr(args, "pack_documents"):  # a run recorded before packing existed trained unpacked
            defaults.setdefault("pack_documents", False)
        defaults = _stages_of_the_typed_schedule(args, defaults, str(record))
    if args.config:
        ignored = getattr(args, "config_ignores", ())
        defaults |= read_config_file(args.config, args.command_parser, ignored)
        if getattr(args, "resume", False) and "out" not in args.typed:
            defaults |= _resumed_run(args.own_parser.prog, args.config, defaults.get("out"))
        left_out = [key for key in read_toml(args.config) if key.replace("-", "_") in ignored]
        if left_out:
            print(f"{args.own_parser.prog}: --config {args.config}: leaves out {', '.join(left_out)} (a training "
                  "run's own options; a check takes --steps, 3 by default)", file=sys.stderr)
    args.command_parser.set_defaults(**defaults)
    given = {"data_given": args.data_given, "typed": args.typed}
    args = parser.parse_args(argv)
    vars(args).update(given)
    return args


def _stages_of_the_typed_schedule(args: argparse.Namespace, recorded: dict, record: str) -> dict:
    """A resume that types a schedule without model chunks (`--pp-schedule 1f1b`) leaves the record's
    `virtual_stages` behind, unless it types `--virtual-stages` too: the recorded stages were the interleaved
    schedule's, and keeping them refused the run until `--virtual-stages 1` was added."""
    from orangetron.spec.variants import SCHEDULES

    if "pp_schedule" not in args.typed or "virtual_stages" in args.typed or recorded.get("virtual_stages", 1) == 1:
        return recorded
    if args.pp_schedule not in SCHEDULES or SCHEDULES[args.pp_schedule].chunks:  # an unknown name is refused later
        return recorded
    print(f"{args.own_parser.prog}: note: --pp-schedule {args.pp_schedule} runs no model chunks: the run's record "
          f"{record} holds virtual_stages={recorded['virtual_stages']}, which this run sets to 1", file=sys.stderr)
    return {**recorded, "virtual_stages": 1}


if __name__ == "__main__":
    sys.exit(main())
