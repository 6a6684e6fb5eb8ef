"""Engines stepped in lockstep: one step of each in turn, the order alternating, each step timed
alone. A neighbour's burst on a shared machine then slows every engine alike, and ratios compare
steps taken a fraction of a second apart (whole runs one after the other drift by +-10 % here)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class Spent:
    """Wall and process CPU seconds of one engine's own steps."""

    seconds: float = 0.0
    cpu_s: float = 0.0


def lockstep(
    engines: Mapping[str, Any], on_outputs: Callable[[str, list], None]
) -> dict[str, Spent]:
    """Step every engine that has unfinished requests, one step each in turn, until none has;
    each step's outputs go to `on_outputs(name, outputs)`."""
    spent = {name: Spent() for name in engines}
    active, turn = [name for name in engines if engines[name].has_unfinished()], 0
    while active:
        for name in active if turn % 2 == 0 else active[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            outputs = engines[name].step()
            spent[name].seconds += time.perf_counter() - wall
            spent[name].cpu_s += time.process_time() - cpu
            on_outputs(name, outputs)
        active = [name for name in active if engines[name].has_unfinished()]
        turn += 1
    return spent
