"""A knob is declared once: `knob(default, help, ...)` is a dataclass field whose metadata holds
what its flag needs (help, choices, a parser, bounds). Sub-configs are frozen dataclasses of
knobs; a tree nests them. From the declarations come the flags (flags.py), the validation
(`check`), the flat keyword form (`build`: every knob name is unique in a tree) and JSON
(`to_dict` / `from_dict`) that `kvmesh up` hands its children."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvmesh.errors import InvalidRequestError


@dataclass(frozen=True)
class Alias:
    """Another spelling of a knob's flag, with its own parser (e.g. --kv-cache-mib)."""

    flag: str
    parse: Callable[[str], Any]
    help: str


@dataclass(frozen=True)
class Knob:
    help: str
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None  # flag text -> value (default: the default's type)
    flag: str = ""  # default: --the-field-name
    metavar: str | None = None
    # value | on_off (a bool spelled on/off) | switch (a bool, no value) | append (a tuple of
    # strings, the flag repeated)
    style: str = "value"
    bounds: tuple[float | None, float | None] = (None, None)  # inclusive
    aliases: tuple[Alias, ...] = ()

    def flag_of(self, name: str) -> str:
        return self.flag or "--" + name.replace("_", "-")


def knob(default: Any, help: str, **meta: Any) -> Any:
    """A config field with its flag's description (see Knob)."""
    return field(default=default, metadata={"knob": Knob(help, **meta)})


def section(cls: type) -> Any:
    """A sub-config field of a tree, its default the sub-config's defaults."""
    return field(default_factory=cls, metadata={"section": cls})


def iter_knobs(cls: type) -> Iterator[tuple[str, dataclasses.Field, Knob]]:
    """(section path, field, knob) of every knob of a config tree, in declaration order."""
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            for path, inner, spec in iter_knobs(f.metadata["section"]):
                yield (f"{f.name}.{path}" if path else f.name), inner, spec
        elif "knob" in f.metadata:
            yield "", f, f.metadata["knob"]


def knob_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for _, f, _ in iter_knobs(cls))


def check(config: Any) -> None:
    """Choices and bounds of a sub-config's own knobs (call from __post_init__)."""
    for f in dataclasses.fields(config):
        spec = f.metadata.get("knob")
        if spec is None:
            continue
        value = getattr(config, f.name)
        unset = value is None and f.default is None  # an optional knob not given
        if spec.choices is not None and not unset and value not in spec.choices:
            raise InvalidRequestError(f"{f.name} must be one of {spec.choices}, got {value!r}")
        low, high = spec.bounds
        if value is not None and (
            (low is not None and value < low) or (high is not None and value > high)
        ):
            raise InvalidRequestError(f"{f.name} must be in {_range(low, high)}, got {value!r}")


def _range(low: float | None, high: float | None) -> str:
    if high is None:
        return f">= {low}"
    return f"<= {high}" if low is None else f"{low}..{high}"


def build(cls: type, **flat: Any) -> Any:
    """A tree from knob names alone (`EngineConfig` from `model=..., kv_dtype=...`)."""
    values = _nest(cls, flat)
    if flat:
        raise TypeError(f"{cls.__name__} has no knob {', '.join(sorted(flat))}")
    return values


def _nest(cls: type, flat: dict[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            kwargs[f.name] = _nest(f.metadata["section"], flat)
        elif f.name in flat:
            kwargs[f.name] = flat.pop(f.name)
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def from_dict(cls: type, raw: dict[str, Any]) -> Any:
    """Inverse of `to_dict`; an unknown key is an error (a config from another version)."""
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{cls.__name__}: expected an object, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise InvalidRequestError(f"{cls.__name__} has no field {', '.join(unknown)}")
    kwargs = {}
    for name, value in raw.items():
        sub = fields[name].metadata.get("section")
        if sub is not None:
            value = from_dict(sub, value)
        elif isinstance(value, list):  # JSON has no tuples (repeatable knobs)
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def flat(config: Any) -> dict[str, Any]:
    """Knob name -> value over a whole tree (the inverse of `build`)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "section" in f.metadata:
            out |= flat(value)
        elif "knob" in f.metadata:
            out[f.name] = value
    return out


def with_knobs(config: Any, **changes: Any) -> Any:
    """`config` with some knobs changed, by name (dataclasses.replace across sections); its
    plain fields (a worker's role) kept."""
    plain = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if "section" not in f.metadata and "knob" not in f.metadata
    }
    return build(type(config), **(flat(config) | plain | changes))
