from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes", "page_bytes", "layout_key")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    layout_key: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., layout_key: _Optional[str] = ...) -> None: ...

class PageLocation(_message.Message):
    __slots__ = ("block_hash", "tier", "address", "page_bytes", "digest")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    tier: str
    address: int
    page_bytes: int
    digest: int
    def __init__(self, block_hash: _Optional[int] = ..., tier: _Optional[str] = ..., address: _Optional[int] = ..., page_bytes: _Optional[int] = ..., digest: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_pages", "locations", "te_session", "lease_id", "lease_ms")
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    TE_SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    hit_pages: int
    locations: _containers.RepeatedCompositeFieldContainer[PageLocation]
    te_session: str
    lease_id: str
    lease_ms: int
    def __init__(self, hit_pages: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[PageLocation, _Mapping]]] = ..., te_session: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("block_hashes", "page_bytes", "layout_key")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    layout_key: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., layout_key: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("accepted_hashes", "addresses", "te_session", "reservation_id", "ttl_ms")
    ACCEPTED_HASHES_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TE_SESSION_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    accepted_hashes: _containers.RepeatedScalarFieldContainer[int]
    addresses: _containers.RepeatedScalarFieldContainer[int]
    te_session: str
    reservation_id: str
    ttl_ms: int
    def __init__(self, accepted_hashes: _Optional[_Iterable[int]] = ..., addresses: _Optional[_Iterable[int]] = ..., te_session: _Optional[str] = ..., reservation_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "digests")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    digests: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_id: _Optional[str] = ..., digests: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed", "rejected")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    rejected: int
    def __init__(self, committed: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "pages", "bytes", "capacity_pages", "hits", "misses", "evictions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    pages: int
    bytes: int
    capacity_pages: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, tier: _Optional[str] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_pages: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("tiers", "promotions", "corrupt_pages", "leases", "reservations", "layout_key", "page_bytes")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    promotions: int
    corrupt_pages: int
    leases: int
    reservations: int
    layout_key: str
    page_bytes: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., promotions: _Optional[int] = ..., corrupt_pages: _Optional[int] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., layout_key: _Optional[str] = ..., page_bytes: _Optional[int] = ...) -> None: ...
