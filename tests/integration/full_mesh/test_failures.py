"""The full mesh when things go wrong: clients that drop, aborts mid-prefill, killed prefill and
decode workers (last: they kill workers)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh import SamplingParams
from kvmesh.proto.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
)
from tests.integration.full_mesh.helpers import (
    kill_busy_decode,
    workers_of,
)
from tests.integration.mesh_probes import (
    pages_in_use,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)


def test_client_disconnect_frees_pages(client, mesh):
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Count to one thousand."}],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 20
    while (used := pages_in_use(mesh)) and time.time() < deadline:
        time.sleep(0.5)
    assert used == 0, "pages stranded on a prefill or decode worker after the client left"


def test_decode_abort_while_its_prefill_runs_ends_the_request(mesh):
    """Decode.Abort arriving while the prefill worker computes the prompt: the prefill is told
    to stop, the stream ends with finish reason abort and no token, no page stays held."""
    workers = workers_of(mesh)
    decode = next(w for w in workers if w.role == "decode")
    prefill = next(w for w in workers if w.role == "prefill")
    with (
        grpc.insecure_channel(decode.grpc_address) as d,
        grpc.insecure_channel(prefill.grpc_address) as p,
    ):
        stub, prefill_stub = decode_pb2_grpc.DecodeStub(d), prefill_pb2_grpc.PrefillStub(p)
        call = stub.Generate(
            decode_pb2.DecodeRequest(
                request_id="abort-during-prefill",
                prompt_token_ids=list(range(3000, 4200)),
                sampling=common_pb2.SamplingParams(max_tokens=64, temperature=0),
                prefill_address=prefill.grpc_address,
            ),
            timeout=120,
        )

        def prefilling() -> bool:
            loads = prefill_stub.GetLoads(decode_pb2.GetLoadsRequest(), timeout=5).loads
            return loads[0].num_running + loads[0].num_waiting > 0

        wait_for(prefilling, 60, "the prefill worker never started the prompt")
        assert stub.Abort(
            decode_pb2.AbortRequest(request_id="abort-during-prefill"), timeout=10
        ).aborted
        responses = list(call)
    assert [t for r in responses for t in r.token_ids] == []
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    wait_for(lambda: pages_in_use(mesh) == 0, 30, "pages held after the abort")


def test_a_delivery_stream_carries_several_requests_chunks_per_message(mesh):
    """Decode.Deliver: requests naming an open delivery stream get every chunk but the last on
    it, several requests' chunks in one message; put in order by first_index, their tokens are
    those of the same requests without one. No id, or an id already open, is refused."""
    decode = next(w for w in workers_of(mesh) if w.role == "decode")
    sampling = common_pb2.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = {f"delivered-{i}": list(range(2000 + 7 * i, 2030 + 7 * i)) for i in range(3)}
    with grpc.insecure_channel(decode.grpc_address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)

        def generate(request_id: str, delivery_id: str = "") -> list:
            return list(
                stub.Generate(
                    decode_pb2.DecodeRequest(
                        request_id=request_id,
                        prompt_token_ids=prompts[request_id.removesuffix("-alone")],
                        sampling=sampling,
                        delivery_id=delivery_id,
                    ),
                    timeout=120,
                )
            )

        alone = {rid: [t for r in generate(f"{rid}-alone") for t in r.token_ids] for rid in prompts}
        with pytest.raises(grpc.RpcError) as unnamed:
            next(stub.Deliver(decode_pb2.DeliverRequest(), timeout=10))
        assert unnamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        deliver = stub.Deliver(decode_pb2.DeliverRequest(delivery_id="t-1"), timeout=120)
        messages: list = []

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                messages.extend(deliver)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        with ThreadPoolExecutor(3) as pool:
            own = dict(
                zip(prompts, pool.map(lambda rid: generate(rid, "t-1"), prompts), strict=True)
            )

        def tokens() -> int:
            chunks = [r for m in messages for r in m.responses] + sum(own.values(), [])
            return sum(len(r.token_ids) for r in chunks)

        wait_for(lambda: tokens() == 3 * 48, 30, "delivered tokens missing")
        with pytest.raises(grpc.RpcError) as twice:
            next(stub.Deliver(decode_pb2.DeliverRequest(delivery_id="t-1"), timeout=10))
        assert twice.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        deliver.cancel()
        reader.join(10)
    delivered = [r for m in messages for r in m.responses]
    assert any(len({r.request_id for r in m.responses}) > 1 for m in messages)
    for rid, responses in own.items():
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # last: on Generate
        chunks = sorted(
            responses + [r for r in delivered if r.request_id == rid], key=lambda r: r.first_index
        )
        assert [t for r in chunks for t in r.token_ids] == alone[rid]
        assert len([r for r in delivered if r.request_id == rid]) > 0


def test_kill_prefill_then_requests_still_succeed(client, mesh):
    victim = mesh.procs["prefill-0"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    for i in range(3):
        r = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": f"Hi {i}"}],
            max_tokens=8,
            temperature=0,
        )
        assert r.choices[0].message.content


def test_kill_decode_mid_stream_the_stream_goes_on_elsewhere(client, mesh, reference):
    """The stream migrates to the other decode worker (test_mesh_faults has the full case)."""
    ask = [{"role": "user", "content": "Tell me a long story."}]
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=ask,
        max_tokens=64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = []
    for i, chunk in enumerate(stream):
        text.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        if i == 2:
            kill_busy_decode(mesh)  # the decode worker serving this stream
    want = reference.chat(ask, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert "".join(text) == want[0].text
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content
