"""The KV store's config tree: where it serves, its page layout (adopted from the workers in
etcd unless given), its tiers, its transfer engine. `kvmesh serve kvstore` gets its flags from
it; `kvmesh up` writes one for its store."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.engine import DEFAULT_MODEL, KV_DTYPES
from kvmesh.config.knobs import check, knob, section
from kvmesh.config.placement import Placed, Registered, TransferKnobs


@dataclass(frozen=True)
class PageLayout:
    """Pages of exactly the workers' layout, or their calls fail with INVALID_ARGUMENT."""

    page_bytes: int | None = knob(
        None,
        "an explicit page layout: bytes per KV page, with "
        "--model, --page-size, --kv-dtype and --kv-spec (default: the "
        "layout a worker registers in etcd)",
        parse=int,
        bounds=(1, None),
    )
    model: str = knob(DEFAULT_MODEL, "with --page-bytes: the model")
    page_size: int = knob(16, "with --page-bytes: tokens per page", bounds=(1, None))
    kv_dtype: str = knob("fp32", "with --page-bytes: the pages' KV dtype", choices=KV_DTYPES)
    kv_spec: str = knob("", "with --page-bytes: the workers' KV spec key (kv/layout.py)")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class Tiers:
    ram_mib: int = knob(256, "RAM tier capacity (MiB)", bounds=(1, None))
    disk_mib: int = knob(1024, "second tier capacity (MiB; 0: none)", bounds=(0, None))
    disk_dir: str = knob("", "disk tier directory (default: a temporary one, removed on stop)")
    backend: str = knob(
        "disk",
        "the second tier: a disk, or Mooncake Store behind --mooncake-master",
        choices=("disk", "mooncake"),
    )
    mooncake_master: str = knob("", "Mooncake master host:port (--backend mooncake)")
    lease_s: float = knob(
        30.0, "seconds a page read out stays pinned for its reader", bounds=(0, None)
    )
    reservation_s: float = knob(
        60.0, "seconds a reserved page waits for its writer", bounds=(0, None)
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class KVStoreConfig(Placed):
    service: Registered = section(Registered)
    layout: PageLayout = section(PageLayout)
    tiers: Tiers = section(Tiers)
    transfer: TransferKnobs = section(TransferKnobs)
