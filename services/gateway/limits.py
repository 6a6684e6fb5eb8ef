"""The gateway's request limits (flags of `kvmesh serve gateway` / `kvmesh up`): the config
tree's section (kvmesh/config/gateway.py), its defaults here for the gateway's modules."""

from __future__ import annotations

from kvmesh.config.gateway import RequestLimits

__all__ = ["DEFAULT_LIMITS", "RequestLimits"]

DEFAULT_LIMITS = RequestLimits()
