"""``--config run.toml``: a command's long options, read from a TOML file.

The file holds the same names as the long options, with dashes or
underscores (``target-batch-size = 512`` or ``target_batch_size = 512``), at
the top level. Its values become the parser's defaults, so any flag given on
the command line overrides them. Each value is checked against the option it
names: an integer option takes a TOML integer, a float option a number, a
text option a string, a flag (``--client-mode``) a boolean, a repeatable option
(``--initial-peer``) a string or a list of strings (its flags on the
command line replace the list), and a value outside an
option's ``choices`` is refused. The first bad key raises ``ConfigError``
naming the file and the key, which the CLI reports in one line with exit 2.

This module knows argparse and TOML, nothing of the layers below: the values
it passes on are checked again where they are used (the config dataclasses).
"""

from __future__ import annotations

import argparse
import math
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._errors import ConfigError

#: Options a config file may not set: the file itself, and help.
_NOT_IN_FILE = frozenset({"config", "help"})


def config_path(argv: Sequence[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config F`` or ``--config=F``),
    or None. Everything after ``--`` is a positional argument, not an option."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg[len("--config=") :]
    return None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The top-level table of the TOML file at ``path``.

    Raises ``ConfigError`` (one line, naming the file) if it is missing,
    unreadable or not valid TOML.
    """
    source = Path(path)
    try:
        with source.open("rb") as file:
            return tomllib.load(file)
    except OSError as e:
        raise ConfigError(f"cannot read config file {source}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {source} is not valid TOML: {e}") from e


def option_defaults(
    parser: argparse.ArgumentParser, values: dict[str, Any], *, source: str
) -> dict[str, Any]:
    """``values`` (from a config file) as parser defaults: ``{dest: value}``.

    Keys are long option names without the leading dashes, with dashes or
    underscores. Raises ``ConfigError`` naming ``source`` and the key for an
    unknown key, a key given twice (``a-b`` and ``a_b``) or a value of the
    wrong type.
    """
    actions = _long_options(parser)
    defaults: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in values.items():
        name = key.replace("_", "-")
        action = actions.get(name)
        if action is None or name in _NOT_IN_FILE:
            raise ConfigError(f"{source}: unknown key {key!r} (not an option of this command)")
        if action.dest in given:
            raise ConfigError(f"{source}: key {key!r} repeats {given[action.dest]!r}")
        given[action.dest] = key
        defaults[action.dest] = _checked(action, value, f"{source}: key {key!r}")
    return defaults


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    options: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse offers no public list of a parser's options
        for string in action.option_strings:
            if string.startswith("--"):
                options[string[2:]] = action
    return options


def _checked(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` for ``action`` as parsing its flag would have produced it."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{where} must be a string or a list of strings, got {value!r}")
        return [_scalar(action, item, where) for item in items]
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    kind = action.type
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        value = float(value)
        if math.isnan(value):
            raise ConfigError(f"{where} must be a number, got nan")
    elif kind is None or kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
    else:
        # An option with its own converter (none today): it takes the text form.
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        try:
            value = kind(value)  # type: ignore[operator]
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{where}: {e}") from e
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise ConfigError(f"{where} must be one of {choices}, got {value!r}")
    return value


def parse_with_config(
    parser: argparse.ArgumentParser,
    subparsers: dict[str, argparse.ArgumentParser],
    argv: Sequence[str],
) -> argparse.Namespace:
    """Parse ``argv`` with ``parser``; a ``--config FILE`` in it supplies the
    chosen subcommand's defaults first (see the module docstring).

    ``subparsers`` maps command names to their parsers. The command is the
    first argument (as ``swarm`` has no options before it). Raises
    ``ConfigError`` for a bad file; argparse exits 2 for bad flags.
    """
    path = config_path(argv)
    if path is None or not argv or argv[0] not in subparsers:
        return parser.parse_args(argv)
    sub = subparsers[argv[0]]
    if "config" not in {a.dest for a in sub._actions}:
        return parser.parse_args(argv)  # argparse reports the unknown --config
    defaults = option_defaults(sub, read_config_file(path), source=path)
    sub.set_defaults(**defaults)
    args = parser.parse_args(argv)
    # argparse appends a repeatable option's flags to its default; a flag on
    # the command line replaces the file's list instead, like any other flag.
    for action in sub._actions:
        file_items = defaults.get(action.dest)
        if isinstance(action, argparse._AppendAction) and file_items and _given(action, argv):
            setattr(args, action.dest, getattr(args, action.dest)[len(file_items) :])
    return args


def _given(action: argparse.Action, argv: Sequence[str]) -> bool:
    """Whether ``argv`` holds one of ``action``'s flags before any ``--``."""
    for arg in argv:
        if arg == "--":
            return False
        if any(arg == o or arg.startswith(o + "=") for o in action.option_strings):
            return True
    return False
