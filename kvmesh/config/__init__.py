"""kvmesh's config tree: frozen sub-configs of knobs, each declared once (knobs.py) with its
default, help and validation; the CLI's flags are made from them (flags.py). Imports nothing
of the engine, the mesh or the services: every layer may read it."""

from kvmesh.config.engine import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    Int4Scheme,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvmesh.config.worker import ServiceConfig, ServingConfig, WorkerConfig

__all__ = [
    "CacheConfig",
    "DeviceConfig",
    "EngineConfig",
    "Int4Scheme",
    "LoadConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServiceConfig",
    "ServingConfig",
    "SpeculativeConfig",
    "WorkerConfig",
]
