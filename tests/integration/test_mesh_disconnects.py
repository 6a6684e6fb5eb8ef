"""Clients that leave early (issue 45, item 6): a burst of streams, each dropped at some stage of
its request's life -- reserving pages, prefilling, handed over, at its first token, running --
through both ways a prompt reaches decode (a prefill worker computes a long one; the decode
worker prefills a short one itself). Every KV page must come back: a request left decoding holds
its pages until max_tokens, minutes here."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh.mesh.launcher import UpOptions
from kvmesh.mesh.up_config import worker_configs
from kvmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.integration.mesh_probes import live_workers, metric_sum, module_mesh, pages_in_use

pytestmark = pytest.mark.timeout(600)
MODEL = "smollm2-135m"
LOCAL_PREFILL = 64  # --local-prefill-tokens: prompts this short are prefilled on decode
MAX_TOKENS = 8000  # (the context is 8,192) a request decoding on without its client: minutes
IDLE_WITHIN_S = 45.0  # every page back by then: far less than MAX_TOKENS of decoding
LONG = "Tell me everything you know about the rivers, mountains and old towns of Europe. " * 9
SHORT = "Name a river."  # 34 tokens as a chat, LONG 175: one each side of LOCAL_PREFILL


@pytest.fixture(scope="module")
def mesh():
    options = UpOptions(
        workers=worker_configs(
            "--kv-cache-mib",
            "384",
            "--max-num-seqs",
            "32",
            decode=("--local-prefill-tokens", str(LOCAL_PREFILL)),
        ),
        prefill=1,
        decode=1,
    )
    with module_mesh(options) as running:
        yield running


def _rest_dropped_after_first_chunk(port: int, content: str) -> bool:
    """A streamed chat request over a raw socket, closed as soon as its first event came;
    True when one came."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head.encode() + body)
        seen = b""
        while b"data:" not in seen:
            data = sock.recv(4096)
            if not data:
                return False
            seen += data
        return True


def _grpc_dropped(stub, token_ids: list[int], after_s: float | None) -> None:
    """A gateway Generate call cancelled `after_s` seconds after it was made (before any
    message, if that is sooner), or with None right after its first message."""
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=token_ids),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    call = stub.Generate(request, timeout=120)
    if after_s is None:
        next(call)
    else:
        time.sleep(after_s)
    call.cancel()


def _prompts_tokens(n: int, length: int, seed: int) -> list[list[int]]:
    return [[1000 + (seed * 97 + i * 31 + j * 7) % 20000 for j in range(length)] for i in range(n)]


def test_a_burst_of_dropped_streams_leaves_no_page_held(mesh):
    """16 REST streams (half long, half short prompts) closed after their first event, and 16
    gateway gRPC calls cancelled at spread-out moments from their start (during reserve,
    prefill, hand-over) or after their first message: within IDLE_WITHIN_S no decode or prefill
    worker holds a page."""
    prefill = live_workers(mesh, "prefill")[0].metrics_address
    prefilled_before = metric_sum(prefill, "kvmesh_prefix_lookup_tokens_total")
    delays = [0.0, 0.01, 0.03, 0.06, 0.1, 0.15, 0.25, None]
    go = threading.Barrier(32)
    with (
        grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as channel,
        ThreadPoolExecutor(32) as pool,
    ):
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def rest(i: int) -> bool:
            go.wait()
            return _rest_dropped_after_first_chunk(mesh.http_port, (LONG if i % 2 else SHORT))

        def cancelled(i: int, tokens: list[int]) -> None:
            go.wait()
            _grpc_dropped(stub, tokens, delays[i % len(delays)])

        long, short = _prompts_tokens(8, 170, 1), _prompts_tokens(8, 24, 2)
        futures = [pool.submit(rest, i) for i in range(16)]
        futures += [pool.submit(cancelled, i, t) for i, t in enumerate(long + short)]
        results = [f.result() for f in futures]
    assert all(results[:16]), "a REST stream ended before its first event"
    assert metric_sum(prefill, "kvmesh_prefix_lookup_tokens_total") > prefilled_before
    deadline = time.monotonic() + IDLE_WITHIN_S
    while (held := pages_in_use(mesh)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held == 0, f"{held} KV pages still held {IDLE_WITHIN_S} s after the clients left"
