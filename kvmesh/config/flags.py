"""argparse flags made from a config tree's knobs, and the tree read back from the parsed
namespace: a knob's flag, help, choices and default are its declaration's (knobs.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvmesh.config.knobs import Knob, build, flat, from_dict, iter_knobs
from kvmesh.errors import InvalidRequestError


def on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse reports a ValueError as 'invalid <function name> value'; say what was wrong."""

    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_flag.__name__ = getattr(parse, "__name__", "value")
    return parse_flag


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
    notes: dict[str, str] | None = None,
    prefix: str = "",
) -> None:
    """A flag per knob of `cls`'s tree (but `skip`), in one argument group per section;
    `defaults` and `notes` (added to the help): a command's own (e.g. `up`'s local prefill);
    `prefix`: whose knobs they are, in each flag and dest (`up`'s --kvstore-ram-mib)."""
    skip, defaults, notes = set(skip), defaults or {}, notes or {}
    groups: dict[str, Any] = {}
    for path, f, spec in iter_knobs(cls):
        if f.name in skip:
            continue
        if path not in groups:
            groups[path] = parser.add_argument_group(path) if path else parser
        group = groups[path]
        default = defaults.get(f.name, f.default)
        argument = _argument(default, spec, f.default)
        argument["help"] += notes.get(f.name, "")
        flag, dest = spec.flag_of(f.name), f.name
        if prefix:
            flag, dest = f"--{prefix}-{flag[2:]}", f"{prefix}_{dest}"
        group.add_argument(flag, dest=dest, **argument)
        for alias in spec.aliases:
            metavar = alias.flag.rsplit("-", 1)[-1].upper()  # --kv-cache-mib: MIB
            group.add_argument(
                alias.flag, dest=f.name, type=_typed(alias.parse), help=alias.help, metavar=metavar
            )


def _argument(default: Any, spec: Knob, declared: Any) -> dict[str, Any]:
    """argparse's keywords for a knob (`declared`: its default in the tree, which sets the
    value's type; `default`: the command's)."""
    if spec.style == "switch":
        return {"action": "store_true", "default": default, "help": spec.help}
    if spec.style == "append":  # repeatable; None (not given) reads back as the default
        return {"action": "append", "default": None, "help": spec.help, "metavar": spec.metavar}
    shown = {True: "on", False: "off"}.get(default, default) if spec.style == "on_off" else default
    text = spec.help if shown in (None, "") else f"{spec.help} (default: {shown})"
    kwargs: dict[str, Any] = {"default": default, "help": text, "metavar": spec.metavar}
    if spec.style == "on_off":
        return kwargs | {"type": on_off, "metavar": spec.metavar or "on|off"}
    parse = spec.parse or (type(declared) if declared is not None else str)
    kwargs["type"] = parse if parse in (int, float, str) else _typed(parse)
    if spec.choices is not None and spec.metavar is None:
        kwargs["choices"] = spec.choices
    return kwargs


def from_namespace(cls: type, args: argparse.Namespace, prefix: str = "", **given: Any) -> Any:
    """`cls`'s tree from the flags `add_flags` defined (a knob without a flag: its default)."""
    values = {}
    for _, f, spec in iter_knobs(cls):
        dest = f"{prefix}_{f.name}" if prefix else f.name
        value = getattr(args, dest, None if spec.style == "append" else f.default)
        if spec.style == "append":
            value = f.default if value is None else tuple(value)
        values[f.name] = value
    return build(cls, **(values | given))


class ConfigFile(argparse.Action):
    """`--config FILE`: a tree's JSON (`kvmesh config show`, or what `kvmesh up` writes for its
    children) as the values of its flags; flags after it on the command line win."""

    def __init__(self, option_strings: list[str], dest: str, root: type, **kwargs: Any) -> None:
        self.root = root
        super().__init__(option_strings, dest, metavar="FILE", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            config = read_config(self.root, Path(str(values)))
        except (OSError, ValueError, InvalidRequestError) as exc:
            parser.error(f"--config {values}: {exc}")
        setattr(namespace, self.dest, str(values))
        for name, value in flat(config).items():  # a repeatable flag appends to a list
            setattr(namespace, name, list(value) if isinstance(value, tuple) else value)


def read_config(root: type, path: Path) -> Any:
    return from_dict(root, json.loads(path.read_text()))


def parse_flags(cls: type, argv: Sequence[str], **given: Any) -> Any:
    """`cls`'s tree from flags alone (e.g. a worker's, as `kvmesh serve decode` takes them)."""
    parser = argparse.ArgumentParser(prog=cls.__name__)
    add_flags(parser, cls)
    return from_namespace(cls, parser.parse_args(list(argv)), **given)
