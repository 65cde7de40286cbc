"""Command-line flags made from the config dataclasses, so that each setting is defined once.

A setting is a dataclass field declared with `setting(...)`: its default, help text,
choices and flag name live in the field. `add_arguments` turns the fields of a
command's sections into argparse arguments (one group per section), `build` makes
the dataclass back from the parsed namespace. A flag's `dest` is always its field's
name, so one dest is one setting in every command that has it: that is what lets
`pdserve serve` hand each process it starts the settings they share (`--config
FILE`, a JSON object keyed by flag name) instead of rebuilding a command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import types
import typing
import weakref
from dataclasses import MISSING, dataclass, field
from typing import Any

log = logging.getLogger("pdserve.flags")
_META = "pdserve.setting"
_INTERNAL = "pdserve.internal"
# the settings each parser was given, by flag name (without the dashes): for --config
_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def setting(
    default: Any = MISSING,
    *,
    help: str,
    flag: str | None = None,
    choices: typing.Iterable[str] | None = None,
    spellings: dict[str, str] | None = None,
    deprecated: tuple[str, ...] = (),
    env: str | None = None,
    secret: bool = False,
    metavar: str | None = None,
    default_factory: Any = MISSING,
):
    """A dataclass field that is also a command-line flag.

    flag: the flag's name when it is not `--field-name` (vLLM's name, say);
    spellings: other accepted spellings of a value and the canonical one each means
    (`bf16` -> `bfloat16`), so help and output show one; deprecated: old flag names
    still accepted with a warning; env: an environment variable read as the default;
    secret: never written into a child's config file nor logged (it reaches children
    through their environment)."""
    meta = dict(
        help=help,
        flag=flag,
        choices=tuple(choices) if choices is not None else None,
        spellings=dict(spellings or {}),
        deprecated=tuple(deprecated),
        env=env,
        secret=secret,
        metavar=metavar,
    )
    return field(default=default, default_factory=default_factory, metadata={_META: meta})


def internal(default: Any = MISSING, *, why: str, default_factory: Any = MISSING):
    """A field of a settings dataclass that is deliberately not a flag; `why` says why."""
    return field(default=default, default_factory=default_factory, metadata={_INTERNAL: why})


@dataclass(frozen=True)
class Section:
    """Some fields of a settings dataclass, as one command offers them.

    defaults: the command's own default for a field, where the dataclass's does not fit
    it (a worker listens on any free port, not 8000); why must say why."""

    cls: type
    only: tuple[str, ...] | None = None
    defaults: dict = field(default_factory=dict)
    why: str = ""

    def __post_init__(self):
        if self.defaults and not self.why:
            raise ValueError(f"{self.cls.__name__}: a command's own defaults need a reason (why=...)")


@dataclass(frozen=True)
class Setting:
    """One flag as a command has it."""

    cls: type
    name: str  # the field, and the argparse dest
    flag: str  # without the leading dashes
    type: Any
    default: Any
    meta: dict

    @property
    def is_bool(self) -> bool:
        return self.type is bool


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _base_type(hint: Any) -> Any:
    """int | None -> int; list[str] -> list."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _base_type(args[0])
    return origin or hint


def settings(section: Section) -> list[Setting]:
    """The flags a section gives, in field order. A field with neither `setting()` nor
    `internal()` is an error: each field of a settings dataclass says which it is."""
    hints = typing.get_type_hints(section.cls)
    out = []
    names = {f.name for f in dataclasses.fields(section.cls)}
    unknown = set(section.only or ()) - names | set(section.defaults) - names
    if unknown:
        raise ValueError(f"{section.cls.__name__} has no field {sorted(unknown)}")
    for f in dataclasses.fields(section.cls):
        if section.only is not None and f.name not in section.only:
            continue
        if _INTERNAL in f.metadata:
            continue
        if _META not in f.metadata:
            raise TypeError(f"{section.cls.__name__}.{f.name}: declare it with setting() or internal()")
        meta = f.metadata[_META]
        default = section.defaults.get(f.name, _field_default(f))
        if meta["env"] and os.environ.get(meta["env"]):
            default = os.environ[meta["env"]]
        flag = (meta["flag"] or "--" + f.name.replace("_", "-")).lstrip("-")
        out.append(Setting(section.cls, f.name, flag, _base_type(hints[f.name]), default, meta))
    return out


def registered(parser: argparse.ArgumentParser) -> dict[str, Setting]:
    """The settings `add_arguments` gave a parser, by flag name (without the dashes)."""
    return {k: v for k, v in _REGISTRY.get(parser, {}).items() if v is not None}


def _canonical(spellings: dict[str, str], base: Any):
    def convert(text: str):
        return base(spellings.get(text, text))

    convert.__name__ = getattr(base, "__name__", "value")  # argparse names it in its errors
    return convert


def _help(s: Setting) -> str:
    text = s.meta["help"]
    choices = s.meta.get("choices")
    # only the spellings of values this flag takes (fp32 is no KV dtype a plan models, say)
    spellings = [k for k, v in (s.meta["spellings"] or {}).items() if not choices or v in choices]
    if spellings:
        text += " (also accepted: " + ", ".join(spellings) + ")"
    if s.meta["env"]:
        text += f" (env {s.meta['env']})"
    if s.is_bool:
        if s.default is None:  # `bool | None = None`: decided later; the help says by what
            return text
        return text + (" (default: on)" if s.default else " (default: off)")
    if "%(default)" in text or s.default in (None, "", ()) or s.meta["secret"]:
        return text
    return text + " (default: %(default)s)"


def add_arguments(parser: argparse.ArgumentParser, sections: typing.Iterable[Section], config_file: bool = False):
    """One argparse group per section, one argument per setting; with config_file, a
    `--config FILE` whose JSON object sets any of them (flags given on the command
    line win over the file)."""
    known = _REGISTRY.setdefault(parser, {})
    for section in sections:
        group = parser.add_argument_group(title(section.cls))
        for s in settings(section):
            if s.flag in known:
                raise ValueError(f"--{s.flag} is defined twice in one command")
            known[s.flag] = s
            group.add_argument("--" + s.flag, **_kwargs(s))
            if s.meta["deprecated"] and s.is_bool:
                raise ValueError(f"--{s.flag}: deprecated names of a boolean flag are not supported")
            for old in s.meta["deprecated"]:
                group.add_argument(
                    old, dest=s.name, action=Deprecated, replacement="--" + s.flag, help=argparse.SUPPRESS, **_value(s)
                )
    if config_file and "config" not in known:
        known["config"] = None
        parser.add_argument(
            "--config",
            action=_ConfigFile,
            metavar="FILE",
            help='a JSON object of settings keyed by flag name, e.g. {"max-num-seqs": 8}; flags given on the '
            "command line win over it (pdserve serve starts its router and workers with one each)",
        )


def title(cls: type) -> str:
    """A section's heading in --help: the first line of its docstring."""
    return (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")


def _value(s: Setting) -> dict:
    """type, nargs and choices of a flag that takes a value."""
    kw: dict[str, Any] = {"default": s.default}
    if s.type is list:
        kw["nargs"] = "+"
    elif s.type in (int, float, str):
        kw["type"] = _canonical(s.meta["spellings"], s.type) if s.meta["spellings"] else s.type
    if s.meta["choices"] is not None:
        kw["choices"] = s.meta["choices"]
    if s.meta["metavar"]:
        kw["metavar"] = s.meta["metavar"]
    elif s.flag != s.name.replace("_", "-") and s.meta["choices"] is None:
        kw["metavar"] = s.flag.upper().replace("-", "_")  # argparse would name it after the dest
    return kw


def _kwargs(s: Setting) -> dict:
    if s.is_bool:
        return {"dest": s.name, "action": argparse.BooleanOptionalAction, "default": s.default, "help": _help(s)}
    return {"dest": s.name, "help": _help(s), **_value(s)}


class Deprecated(argparse.Action):
    """An old flag name: still works, and says which to use."""

    def __init__(self, *a, replacement: str, **kw):
        self.replacement = replacement
        super().__init__(*a, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        # parsing comes before logging is configured: logging's last-resort handler prints it
        log.warning("%s is deprecated: use %s", option_string, self.replacement)
        setattr(namespace, self.dest, values)


class _ConfigFile(argparse.Action):
    def __call__(self, parser, namespace, path, option_string=None):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            parser.error(f"--config {path}: {e}")
        if not isinstance(doc, dict):
            parser.error(f"--config {path}: a JSON object of settings, keyed by flag name")
        known = _REGISTRY.get(parser, {})
        for key, value in doc.items():
            s = known.get(str(key).lstrip("-").replace("_", "-"))
            if s is None:
                parser.error(f"--config {path}: unknown setting {key!r}")
            err = check(s, value)
            if err:
                parser.error(f"--config {path}: {key}: {err}")
            setattr(namespace, s.name, s.meta["spellings"].get(value, value) if isinstance(value, str) else value)


def check(s: Setting, value: Any) -> str | None:
    """Why `value` (from JSON) cannot be this setting, or None when it can."""
    if value is None:
        return None if s.default is None or s.type is list else "may not be null"
    want = {bool: (bool,), int: (int,), float: (int, float), str: (str,), list: (list,)}.get(s.type, (object,))
    if not isinstance(value, want) or (s.type in (int, float) and isinstance(value, bool)):
        return f"expected {s.type.__name__}, got {type(value).__name__}"
    if s.meta["choices"] is not None and s.meta["spellings"].get(value, value) not in s.meta["choices"]:
        return f"{value!r} is not one of {', '.join(map(str, s.meta['choices']))}"
    return None


def values(cls: type, args: argparse.Namespace) -> dict:
    """The fields of `cls` that the namespace holds, by field name."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def build(cls: type, args: argparse.Namespace, **extra):
    """`cls` from a parsed namespace (fields it lacks keep their defaults)."""
    return cls(**{**values(cls, args), **extra})


def document(sections: typing.Iterable[Section], values: dict) -> dict:
    """The config file (`--config`) of a command that has these sections, for the given
    values (by dest): every setting of the command found in `values`, keyed by flag
    name, secrets left out."""
    out = {}
    for section in sections:
        for s in settings(section):
            if s.name in values and not s.meta["secret"]:
                out[s.flag] = values[s.name]
    return out


def non_defaults(sections: typing.Iterable[Section], args: argparse.Namespace) -> dict:
    """The settings that differ from their defaults (secrets masked), for the start-up log."""
    out = {}
    for section in sections:
        for s in settings(section):
            v = getattr(args, s.name, s.default)
            if v != s.default:
                out[s.flag] = "***" if s.meta["secret"] else v
    return out


def log_settings(logger: logging.Logger, sections: typing.Iterable[Section], args: argparse.Namespace) -> None:
    """One start-up line with the settings that differ from their defaults (as vLLM logs its
    non-default args): what this process was really given, whoever started it."""
    logger.info("non-default settings", extra={"fields": {"settings": non_defaults(sections, args)}})


def write_private_json(path: str, doc: dict) -> str:
    """Write `doc` to a new file only its owner can read (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    return path


def config_first(argv: list[str]) -> list[str]:
    """argv with `--config FILE` moved right after the subcommand, so that every flag on
    the command line is applied after the file, and wins."""
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            rest = argv[:i] + argv[i + 2 :]
            cmd = next((j for j, b in enumerate(rest) if not b.startswith("-")), None)
            if cmd is None:
                return argv
            return rest[: cmd + 1] + ["--config", argv[i + 1]] + rest[cmd + 1 :]
        if a.startswith("--config="):
            return config_first(argv[:i] + ["--config", a.split("=", 1)[1]] + argv[i + 1 :])
    return argv
