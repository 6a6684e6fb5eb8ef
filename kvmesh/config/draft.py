"""The draft service's config tree: where it serves and which EAGLE head it runs."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.engine import DEFAULT_MODEL
from kvmesh.config.knobs import knob, section
from kvmesh.config.placement import Placed, Registered


@dataclass(frozen=True)
class DraftHead:
    model: str = knob(DEFAULT_MODEL, "the target model (its token embeddings feed the head)")
    draft_model: str = knob("", "EAGLE head file (default: the one shipped for the model)")


@dataclass(frozen=True)
class DraftConfig(Placed):
    service: Registered = section(Registered)
    head: DraftHead = section(DraftHead)
