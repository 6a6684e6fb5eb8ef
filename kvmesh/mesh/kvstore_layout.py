"""The page layout a KV store must hold to serve a model's workers: the model's name, the KV
dtype the workers resolve (`--dtype / --weights / --kv-dtype`, "auto" as they do), the page's
bytes and its KV spec key. `kvmesh up` passes it to the store it starts; a store started alone
(`kvmesh serve kvstore --model M` without `--page-bytes`: an image, a pod) derives it here."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config import EngineConfig


@dataclass(frozen=True)
class StoreLayout:
    model: str
    kv_dtype: str
    page_bytes: int
    kv_spec: str
    page_size: int = 16

    def as_flags(self) -> list[str]:
        return ["--model", self.model, "--page-size", str(self.page_size), "--kv-dtype",
                self.kv_dtype, "--page-bytes", str(self.page_bytes), "--kv-spec", self.kv_spec]  # fmt: skip


def store_layout(engine: EngineConfig) -> StoreLayout:
    """The layout of the pages of workers running `engine` (fetches the model's config)."""
    from kvmesh.engine.config import spec_for_model
    from kvmesh.engine.loader import read_config, resolve_model

    source = resolve_model(engine.load.model)
    kv_dtype, page_size = engine.resolved_kv_dtype, engine.cache.page_size
    spec = spec_for_model(read_config(source), page_size, kv_dtype)
    return StoreLayout(source.name, kv_dtype, spec.page_bytes, spec.layout_key, page_size)
