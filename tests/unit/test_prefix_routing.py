"""Prefix index from KV events, prompt hashing identical to the workers', prefix-aware policy."""

from __future__ import annotations

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.kv import BlockHasher, BlockManager, BlockManagerConfig
from kvmesh.mesh.discovery import WorkerInfo
from kvmesh.mesh.kv_events import PrefixIndex, events_to_pb
from kvmesh.proto.v1 import decode_pb2
from kvmesh.routing.prefix import PrefixLookup, PromptKey
from kvmesh.routing.router import Router

PS = 4


def _worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(
        role="decode",
        worker_id=worker_id,
        grpc_address="127.0.0.1:1",
        page_size=PS,
        kv_dtype="fp32",
        model="m",
    )


def _cache(manager: BlockManager, tokens: list[int], salt: str = "") -> None:
    seq = Sequence(f"s{len(tokens)}{salt}", tokens, SamplingParams(), cache_salt=salt)
    assert manager.allocate(seq, len(tokens), manager.match_prefix(seq))
    seq.num_computed_tokens = len(tokens)
    manager.cache_full_pages(seq, len(tokens))
    manager.free(seq)


def test_index_follows_a_real_block_manager_and_matches_gateway_hashes():
    manager = BlockManager(BlockManagerConfig(8, PS), BlockHasher.salted("m", PS, "fp32"))
    index = PrefixIndex()
    index.apply(decode_pb2.KvEventBatch(worker_id="d0", snapshot=True))
    _cache(manager, list(range(10)))  # 2 full pages
    index.apply(decode_pb2.KvEventBatch(worker_id="d0", events=events_to_pb(manager.take_events())))
    lookup = PrefixLookup(index)
    assert lookup.cached_tokens(_worker("d0"), PromptKey("m", list(range(12)))) == 8
    assert lookup.cached_tokens(_worker("d0"), PromptKey("m", list(range(12)), "tenant")) == 0
    assert lookup.cached_tokens(_worker("d1"), PromptKey("m", list(range(12)))) == 0
    first = PromptKey("m", list(range(12))).hashes(PS, "fp32")[0]
    for i in range(10):  # cache other prompts until the first page is evicted
        if first not in manager.cached_hashes():
            break
        _cache(manager, [1000 + 10 * i + j for j in range(8)])
    assert first not in manager.cached_hashes()
    index.apply(decode_pb2.KvEventBatch(worker_id="d0", events=events_to_pb(manager.take_events())))
    assert index.matched_pages("d0", PromptKey("m", list(range(12))).hashes(PS, "fp32")) < 2
    snapshot = decode_pb2.KvEventBatch(worker_id="d0", snapshot=True)
    index.apply(snapshot)
    assert index.matched_pages("d0", PromptKey("m", list(range(12))).hashes(PS, "fp32")) == 0


def test_router_prefers_the_worker_holding_the_prefix_unless_it_is_busier_than_the_saving():
    index = PrefixIndex()
    prompt = PromptKey("m", list(range(40)))
    hashes = prompt.hashes(PS, "fp32")
    index.apply(
        decode_pb2.KvEventBatch(
            worker_id="decode-1", snapshot=True, events=[decode_pb2.KvEvent(stored=hashes[:8])]
        )
    )
    router = Router(
        lambda role: [_worker("decode-0"), _worker("decode-1")], prefix=PrefixLookup(index)
    )
    decision = router.pick("decode", 40, prompt=prompt)
    assert (decision.worker.worker_id, decision.reason) == ("decode-1", "prefix_hit")
    with router.holding("decode-1", 33):  # busier by more than the 32 cached tokens save
        assert router.pick("decode", 40, prompt=prompt).worker.worker_id == "decode-0"
    with router.holding("decode-1", 31):
        assert router.pick("decode", 40, prompt=prompt).worker.worker_id == "decode-1"


def test_a_prefilled_prompt_routes_its_twin_to_the_same_worker_before_any_event():
    """Router.prefilled (the first token of a request arrived): the workers hold the prompt's
    full pages in the index at once, so the same prompt right after goes there; a later
    snapshot from the worker still has the last word."""
    index = PrefixIndex()
    router = Router(lambda role: [_worker("d0"), _worker("d1")], prefix=PrefixLookup(index))
    prompt = PromptKey("m", list(range(10)))
    assert router.pick("decode", 10, prompt=prompt).reason == "least_tokens"
    router.prefilled(prompt, _worker("d1"), None)
    decision = router.pick("decode", 10, prompt=prompt)
    assert (decision.worker.worker_id, decision.reason) == ("d1", "prefix_hit")
    assert index.matched_pages("d1", prompt.hashes(PS, "fp32")) == 2  # full pages only
    index.apply(decode_pb2.KvEventBatch(worker_id="d1", snapshot=True))
    assert router.pick("decode", 10, prompt=prompt).worker.worker_id == "d0"


def test_a_prefill_workers_polled_load_drops_by_the_prompt_it_prefilled():
    router = Router(lambda role: [_worker("p0"), _worker("p1")])
    router._reported.update({"p0": 150, "p1": 40})
    router.prefilled(PromptKey("m", list(range(100))), _worker("d0"), _worker("p0"))
    router.prefilled(PromptKey("m", list(range(100))), _worker("d0"), _worker("p1"))
    assert router._load("p0") == 50 and router._load("p1") == 0
