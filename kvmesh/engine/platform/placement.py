"""A model built on the host, moved onto its platform's device: every tensor it holds (weights,
norms, rotary tables, router biases) goes to the device, and each CPU INT4 linear becomes the
platform's (the same 4-bit values, scales and zeros: the same weights, another kernel).

The walk follows the model's own objects (kvmesh's classes), lists, tuples and dicts; it never
enters torch's or other libraries' objects. `held_devices` is the check: the devices of every
tensor a model holds (a test moves a model to the meta device and expects only meta)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvmesh.engine.quant.int4 import Int4Linear


def place(model: Any, device: torch.device, int4: Callable[[Int4Linear], Any] | None) -> Any:
    """`model` with its tensors on `device` (moved in place; returned for chaining). `int4`
    makes the device's linear from a CPU INT4 one (None: a model holding one is refused)."""
    if device.type == "cpu":
        return model
    seen: set[int] = set()
    moved: dict[int, torch.Tensor] = {}  # a tensor held twice (tied embeddings) moves once

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in moved:
                moved[id(value)] = value.to(device)
            return moved[id(value)]
        if isinstance(value, Int4Linear):
            if int4 is None:
                raise ValueError(f"no INT4 linear for {device.type} tensors")
            return int4(value)
        if isinstance(value, list):
            value[:] = [visit(v) for v in value]
            return value
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(visit(v) for v in value)
        if isinstance(value, dict):
            for key in list(value):
                value[key] = visit(value[key])
            return value
        if _ours(value) and id(value) not in seen:
            seen.add(id(value))
            for name, attr in list(vars(value).items()):
                setattr_or_skip(value, name, visit(attr))
        return value

    return visit(model)


def held_devices(model: Any) -> set[str]:
    """The device types of every tensor `model` holds (the walk `place` takes)."""
    found: set[str] = set()
    seen: set[int] = set()

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.add(value.device.type)
        elif isinstance(value, list | tuple):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif _ours(value) and id(value) not in seen:
            seen.add(id(value))
            for attr in vars(value).values():
                visit(attr)

    visit(model)
    return found


def _ours(value: Any) -> bool:
    return type(value).__module__.startswith("kvmesh.") and hasattr(value, "__dict__")


def setattr_or_skip(obj: Any, name: str, value: Any) -> None:
    """Set an attribute, through object.__setattr__ for frozen dataclasses."""
    if getattr(obj, name) is not value:
        object.__setattr__(obj, name, value)
