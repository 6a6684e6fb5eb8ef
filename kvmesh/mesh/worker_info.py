"""What a worker publishes in etcd about itself (discovery.py puts and watches it)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.errors import WorkerInfoError


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker publishes about itself. New fields need defaults: old readers ignore them."""

    role: str
    worker_id: str
    grpc_address: str
    metrics_address: str = ""
    te_session: str = ""  # Mooncake transfer-engine session id ("host:port")
    delivery_address: str = ""  # decode: its delivery socket ("host:port"; services/decode)
    model: str = ""
    page_size: int = 16
    kv_dtype: str = ""
    capacity_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("role", "worker_id"):
            value = getattr(self, name)
            if not value or "/" in value:
                raise WorkerInfoError(f"{name} must be non-empty without '/': {value!r}")
        if self.page_size <= 0 or self.capacity_tokens < 0:
            raise WorkerInfoError(f"bad page_size/capacity_tokens in {self!r}")

    @property
    def kv_layout(self) -> tuple[str, int, str, str]:
        """(model, page_size, kv_dtype, KV spec key): two workers can exchange pages only if
        these match."""
        return self.model, self.page_size, self.kv_dtype, str(self.extra.get("kv_spec", ""))

    @property
    def name(self) -> str:
        """`role/worker_id`: the key of WorkerWatcher.workers."""
        return f"{self.role}/{self.worker_id}"

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> WorkerInfo:
        try:
            raw = json.loads(data)
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in raw.items() if k in known})
        except (ValueError, TypeError, AttributeError) as e:
            raise WorkerInfoError(f"bad WorkerInfo JSON: {data[:200]!r}") from e
