"""kvmesh: serve large language models as a mesh of gRPC services."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmesh.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":  # lazy: importing kvmesh must not pull in torch
        from kvmesh.engine.llm import LLM

        return LLM
    raise AttributeError(name)
