"""Command-line flags from a config dataclass, each with a `CARPOOL_<FLAG>` env fallback.

Every field becomes `--field-name` (underscores turn into dashes); its help
comes from the field's `metadata["help"]`. The environment is passed in, read
once at the edge, so nothing deeper in the code looks at `os.environ`.
Precedence: flag, then environment variable, then the dataclass default.

Supported field types: `str`, `int`, `float`, `bool`, `str` enums, `X | None` of those,
`list[str]` / `list[int]` (comma-separated) and `dict[str, int]` / `dict[str, float]`
(`key=value,...`). Fields whose metadata has `"flag": False` are skipped. A field whose type is
itself a config dataclass (the worker's `engine`) contributes its own fields as flags, by their own
names (`--max-num-seqs`, not `--engine-max-num-seqs`), and is built from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

ENV_PREFIX = "CARPOOL_"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def help_text(text: str, **extra: Any) -> dict[str, Any]:
    """A field's metadata giving its flag's help."""
    return {"help": text, **extra}


def env_name(field_name: str) -> str:
    """`redis_url` -> `CARPOOL_REDIS_URL`."""
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    """`redis_url` -> `--redis-url`."""
    return "--" + field_name.replace("_", "-")


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE - {''})}, got {text!r}")


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """`int | None` -> (int, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _converter(tp: Any) -> Callable[[str], Any]:
    """A function turning one flag/env string into a value of type `tp`."""
    inner, is_optional = _strip_optional(tp)
    origin = typing.get_origin(inner)
    if origin is list:
        (item,) = typing.get_args(inner)
        item_conv = _converter(item)

        def to_list(text: str) -> list[Any]:
            return [item_conv(part.strip()) for part in text.split(",") if part.strip()]

        to_list.__name__ = "comma-separated list"  # argparse's "invalid <name> value" names it so
        base: Callable[[str], Any] = to_list
    elif origin is dict:
        key_tp, value_tp = typing.get_args(inner)
        key_conv, value_conv = _converter(key_tp), _converter(value_tp)

        def to_dict(text: str) -> dict[Any, Any]:
            out: dict[Any, Any] = {}
            for part in text.split(","):
                if not part.strip():
                    continue
                key, sep, value = part.partition("=")
                if not sep:
                    raise ValueError(f"expected key=value, got {part!r}")
                out[key_conv(key.strip())] = value_conv(value.strip())
            return out

        to_dict.__name__ = "comma-separated key=value list"
        base = to_dict
    elif inner is bool:
        base = parse_bool
    elif inner in (str, int, float):
        base = inner  # NaN and infinity pass: each config's own checks name the setting and its bounds
    elif isinstance(inner, type) and issubclass(inner, enum.Enum) and issubclass(inner, str):
        base = str  # the config's own __post_init__ names the setting and its choices when the text is wrong
    else:
        raise TypeError(f"no flag conversion for type {inner!r}")
    if not is_optional:
        return base

    def maybe(text: str) -> Any:
        return None if text.strip().lower() in ("", "none") else base(text)

    maybe.__name__ = base.__name__  # argparse's "invalid <name> value" names the value's kind
    return maybe


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _is_config(tp: Any) -> bool:
    """A field type that is itself a config dataclass, whose fields are flags of their own."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _flag_fields(cls: type, exclude: Iterable[str]) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    out: list[tuple[dataclasses.Field[Any], Any]] = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip or not f.metadata.get("flag", True):
            continue
        if _is_config(hints[f.name]):
            out += _flag_fields(hints[f.name], skip)
        else:
            out.append((f, hints[f.name]))
    return out


def _flat_values(config: Any) -> dict[str, tuple[Any, Any]]:
    """name -> (value, default) of every field of `config`, nested config dataclasses flattened."""
    hints = typing.get_type_hints(type(config))
    out: dict[str, tuple[Any, Any]] = {}
    for f in dataclasses.fields(config):
        if _is_config(hints[f.name]):
            out.update(_flat_values(getattr(config, f.name)))
        else:
            out[f.name] = (getattr(config, f.name), _default(f))
    return out


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    env: Mapping[str, str],
    *,
    exclude: Iterable[str] = (),
    overrides: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per field of dataclass `cls` to `parser`.

    A value found in `env` becomes the flag's default, so the flag still wins.
    `overrides` replaces dataclass defaults (e.g. `carpool up` picks free ports), `helps` their help texts.
    A malformed env value is reported as a usage error naming the variable.
    """
    group = parser.add_argument_group(f"{cls.__name__} settings (each also read from its CARPOOL_<FLAG> variable)")
    for f, tp in _flag_fields(cls, exclude):
        conv = _converter(tp)
        default = (overrides or {}).get(f.name, _default(f))
        env_var = env_name(f.name)
        if env_var in env:
            try:
                default = conv(env[env_var])
            except (ValueError, TypeError) as e:
                parser.error(f"{env_var}={env[env_var]!r}: {e}")
        help_text = (helps or {}).get(f.name) or f.metadata.get("help", "")
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        if isinstance(default, dict):
            shown = ",".join(f"{k}={v}" for k, v in default.items())
        inner, _ = _strip_optional(tp)
        if inner is bool:
            # A switch that is off by default reads best as a plain `--flag`; one that is on gets `--no-flag`.
            action: Any = "store_true" if _default(f) is False else argparse.BooleanOptionalAction
            group.add_argument(
                flag_name(f.name), dest=f.name, action=action, default=default,
                help=f"{help_text} [env {env_var}]",
            )
        else:
            # A help text that explains its own default keeps it; an empty default says nothing.
            says_default = "default" in help_text or shown in (None, "")
            group.add_argument(
                flag_name(f.name), dest=f.name, type=conv, default=default, metavar=f.name.split("_")[-1].upper(),
                help=f"{help_text}{'' if says_default else f' (default: {shown})'} [env {env_var}]",
            )


def config_from_args(cls: type, args: argparse.Namespace, *, exclude: Iterable[str] = (), **extra: Any) -> Any:
    """Build the dataclass from parsed flags (plus `extra` values for excluded fields)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if _is_config(hints[f.name]) and f.name not in extra:
            values[f.name] = config_from_args(hints[f.name], args, exclude=exclude)
        elif f.init and f.name not in set(exclude) and f.metadata.get("flag", True) and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    values.update(extra)
    return cls(**values)


def config_argv(config: Any, names: Iterable[str]) -> list[str]:
    """The flags that give a child process these fields of `config` (the inverse of `add_config_flags`)."""
    argv: list[str] = []
    values = _flat_values(config)
    for name in names:
        value, default = values[name]
        if value is None or value == default:  # the child's default is the same
            continue
        if isinstance(value, bool):
            # A switch off by default is a plain `--flag`; one on by default is turned off with `--no-flag`.
            argv.append(flag_name(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):
            argv += [flag_name(name), ",".join(f"{k}={v}" for k, v in value.items())]
        elif isinstance(value, list):
            argv += [flag_name(name), ",".join(map(str, value))]
        else:
            argv += [flag_name(name), str(value)]
    return argv


def flag_fields(cls: type, exclude: Iterable[str] = ()) -> list[str]:
    """The field behind every flag `add_config_flags` adds for `cls` (nested config dataclasses flattened)."""
    return [f.name for f, _ in _flag_fields(cls, exclude)]


def flag_error(message: str, *classes: type, also: Iterable[str] = (), env: Mapping[str, str] | None = None,
               argv: Sequence[str] = ()) -> str:
    """A settings error as a command line says it: a message that starts with a field of these config dataclasses,
    or with one of the names in ``also`` (a verb's flags of its own), as their checks word it
    (``max_num_seqs: must be >= 1, got 0``) names that flag instead (``--max-num-seqs: must be >= 1, got 0``), the
    name the user typed; where the value came from ``env`` (its variable set, the flag not in ``argv``), its
    variable too (``--max-num-seqs (CARPOOL_MAX_NUM_SEQS): …``), as a deployment sets it; any other message is
    kept."""
    name, sep, rest = message.partition(": ")
    if sep and (name in set(also) or any(name in flag_fields(cls) for cls in classes)):
        flag, variable = flag_name(name), env_name(name)
        given = any(arg == flag or arg.startswith(flag + "=") for arg in argv)
        return f"{flag}{f' ({variable})' if env and variable in env and not given else ''}: {rest}"
    return message


def env_names(cls: type, exclude: Iterable[str] = ()) -> dict[str, str]:
    """flag -> env variable for every flag `add_config_flags` adds for `cls`."""
    return {flag_name(f.name): env_name(f.name) for f, _ in _flag_fields(cls, exclude)}


def parse_verb_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)` for a parser of verbs (subparsers whose `dest` is ``verb``), but an argument no
    parser knows is refused with the usage of the verb it was given to, not the top level's (a misspelt flag of
    `carpool submit` then shows `submit`'s flags)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        verbs = next((action for action in parser._actions  # argparse keeps its subparsers among its actions
                      if isinstance(action, argparse._SubParsersAction)), None)
        verb_parser = None if verbs is None else verbs.choices.get(getattr(args, "verb", None) or "")
        (verb_parser or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args
