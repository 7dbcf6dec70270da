"""How the command lines word what they print: a count ("1 document", "2 documents", "1,024 tokens"), the unit
a figure reads in, and the flag beside an option's field name in an error the spec raised."""

from __future__ import annotations

import argparse
import re

_LEADING_FIELD = re.compile(r"([a-z][a-z0-9_]*)(=\[[^\]]*\]|=[^\s:]*)?")  # a list value, spaces and all


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """`number` (with thousands separators) and `noun`, in the plural (`plural`, else noun + "s") unless one."""
    return f"{number:,} {noun if number == 1 else plural or noun + 's'}"


BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
SECOND_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))
FLOP_RATE_UNITS = (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6))


def unit_for(largest: float, units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    """(name, size) of the largest of `units` in which `largest` reads at least 0.1, so that a small figure is
    not 0.0 (the smallest unit when none does)."""
    return next(((name, size) for name, size in units if largest >= 0.1 * size), units[-1])


def flag_named(message: str, flags: dict[str, str]) -> str:
    """`message` with `flags[field]` in brackets after the field (and its value) it starts with: the spec's
    rules name the option's field, which a command line user sets by a flag of another spelling. A field is
    written `name=value` (a list value `[...]` whole), or as an identifier with an underscore; a message that
    names its flag is left as is."""
    found = _LEADING_FIELD.match(message)
    field = found.group(1) if found and (found.group(2) or "_" in found.group(1)) else None  # not a plain word
    if field not in flags or message[found.end():].startswith(" (--"):
        return message
    return f"{message[:found.end()]} ({flags[field]}){message[found.end():]}"


def set_by_file(message: str, flags: dict[str, str], typed: set[str], source: str | None,
                file_fields: set[str]) -> str:
    """`message` with "(--flag)" after its leading field told "(--flag, set by SOURCE)" when the command line did
    not type the flag and the file `source` names ("--config FILE", a resumed run's record) gave the field: the
    user looks in the file, not at the command."""
    found = _LEADING_FIELD.match(message)
    field = found.group(1) if found else None
    if not source or field not in file_fields or field in typed or field not in flags:
        return message
    if source.split()[-1] in message:  # the message names the file itself ("differs from the run's record in")
        return message
    return message.replace(f" ({flags[field]})", f" ({flags[field]}, set by {source})", 1)


def typed_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each flag `parser`'s command line holds (`parser.given`, kept as it parses: cli/__init__.py), whatever its
    value, with the option (dest) it sets, in the parser's order: a file's value may not stand in for it."""
    typed = {arg.split("=")[0] for arg in getattr(parser, "given", ())}
    return {flag: action.dest for action in parser._actions for flag in action.option_strings if flag in typed}


def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The flag of `parser` that sets each field a rule may name; where it has no --microbatches, a step's
    micro-batches follow from the global batch. A switch is named by its flag that turns it on (`--x`, not the
    `--no-x` that `argparse.BooleanOptionalAction` adds)."""
    flags = {action.dest: _positive_flag(action.option_strings) for action in parser._actions if action.option_strings}
    return {"microbatches": "--global-batch / (--micro-batch x dp)", **flags}


def _positive_flag(option_strings: list[str]) -> str:
    """The longest of an option's flags, leaving out a switch's negation where it has the flag it negates."""
    negated = {"--no-" + flag[2:] for flag in option_strings}
    return max([flag for flag in option_strings if flag not in negated], key=len)

