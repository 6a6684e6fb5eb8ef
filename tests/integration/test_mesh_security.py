"""Keys and TLS on a live mesh (`kvmesh up --tls` + `--api-key`): every service speaks TLS with a
throwaway CA's certificates, services check each other's (mutual TLS), clients reach the gateway
over TLS with an API key. Wrong or missing keys get 401 in the API's own shape; a plaintext
client, a client without a certificate and one whose certificate comes from another CA are
refused, by the workers and by etcd (TLS, users by certificate name); keys never reach the
logs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import httpx
import pytest

from kvmesh.errors import DiscoveryError
from kvmesh.mesh.certs import make_ca, make_leaf
from kvmesh.mesh.etcd_access import EtcdAccess
from kvmesh.mesh.launcher import UpOptions, list_workers
from kvmesh.mesh.up_config import gateway_config
from kvmesh.proto.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)
from tests.integration.mesh_probes import module_mesh

pytestmark = pytest.mark.timeout(600)
MODEL = "smollm2-135m"
KEY = "sk-test-4d1f0c9e7b"
OTHER_KEY = "sk-test-not-known"
SECOND_KEY = "sk-test-second-tenant"


@pytest.fixture(scope="module")
def mesh():
    options = UpOptions(
        prefill=1,
        decode=1,
        kvstore="none",
        tls=True,
        gateway=gateway_config("--api-key", KEY, "--api-key", SECOND_KEY),
    )
    with module_mesh(options) as running:
        yield running


@pytest.fixture(scope="module")
def base_url(mesh) -> str:
    return f"https://127.0.0.1:{mesh.http_port}"


def _openai(mesh, base_url: str, key: str):
    from openai import OpenAI

    http = httpx.Client(verify=str(mesh.tls.ca))
    return OpenAI(
        base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60, http_client=http
    )


def test_the_right_key_over_tls_gets_an_answer(mesh, base_url):
    reply = _openai(mesh, base_url, KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content


def test_wrong_or_missing_keys_get_401_in_each_apis_shape(mesh, base_url):
    import anthropic
    import openai

    with pytest.raises(openai.AuthenticationError) as wrong:
        _openai(mesh, base_url, OTHER_KEY).models.list()
    assert wrong.value.status_code == 401
    assert wrong.value.body["code"] == "invalid_api_key"
    with httpx.Client(verify=str(mesh.tls.ca)) as http:
        missing = http.post(f"{base_url}/v1/chat/completions", json={"messages": []})
        assert missing.status_code == 401 and "missing" in missing.json()["error"]["message"]
        assert http.get(f"{base_url}/health").status_code == 200  # probes carry no key
    client = anthropic.Anthropic(
        base_url=base_url,
        api_key=OTHER_KEY,
        max_retries=0,
        http_client=anthropic.DefaultHttpxClient(verify=str(mesh.tls.ca)),
    )
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_grpc_gateway_needs_tls_and_a_key(mesh):
    request = gateway_pb2.GenerateRequest(
        prompt="Hello", sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    )
    credentials = grpc.ssl_channel_credentials(mesh.tls.ca.read_bytes())
    address = f"127.0.0.1:{mesh.grpc_port}"
    with grpc.secure_channel(address, credentials) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        replies = list(
            stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {KEY}")])
        )
        assert replies[-1].finish_reason
        with pytest.raises(grpc.RpcError) as unauthenticated:
            list(stub.Generate(request, timeout=60))
        assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as plain, pytest.raises(grpc.RpcError) as refused:
        list(gateway_pb2_grpc.GatewayStub(plain).Generate(request, timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_abort_reaches_only_the_callers_own_request(mesh):
    """Two tenants may pick the same request id: the other tenant's Abort finds nothing, the
    stream runs to its end; the owner's Abort ends it."""
    request = gateway_pb2.GenerateRequest(
        prompt="Count",
        request_id="shared-id",
        sampling=common_pb2.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    )
    credentials = grpc.ssl_channel_credentials(mesh.tls.ca.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{mesh.grpc_port}", credentials) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def as_(key: str) -> list[tuple[str, str]]:
            return [("authorization", f"Bearer {key}")]

        for aborter, expect in ((SECOND_KEY, "length"), (KEY, "abort")):
            stream = stub.Generate(request, timeout=120, metadata=as_(KEY))
            first = next(stream)  # the request is running
            assert first.request_id == "shared-id"
            aborted = stub.Abort(
                decode_pb2.AbortRequest(request_id="shared-id"), timeout=10, metadata=as_(aborter)
            ).aborted
            assert aborted == (aborter == KEY)
            replies = [first, *stream]
            finish = common_pb2.FinishReason.Name(replies[-1].finish_reason)
            assert finish == f"FINISH_REASON_{expect.upper()}", (aborter, finish)


def test_plaintext_rest_is_refused(mesh):
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{mesh.http_port}/health", timeout=10)


def test_workers_accept_only_certificates_of_the_mesh_ca(mesh, tmp_path):
    workers = asyncio.run(list_workers(mesh.etcd.endpoint, "default", mesh.etcd.access))
    decode = next(w for w in workers if w.role == "decode")
    other_ca = make_ca(tmp_path / "other", "another CA")
    stranger = make_leaf(tmp_path / "other", "stranger", other_ca)
    ca = mesh.tls.ca.read_bytes()

    def loads(credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
        with grpc.secure_channel(decode.grpc_address, credentials) as channel:
            try:
                decode_pb2_grpc.DecodeStub(channel).GetLoads(
                    decode_pb2.GetLoadsRequest(), timeout=10
                )
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    member = mesh.tls
    assert (
        loads(grpc.ssl_channel_credentials(ca, member.key.read_bytes(), member.cert.read_bytes()))
        == grpc.StatusCode.OK
    )
    assert loads(grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE  # no cert
    foreign = grpc.ssl_channel_credentials(
        ca, stranger.key.read_bytes(), stranger.cert.read_bytes()
    )
    assert loads(foreign) == grpc.StatusCode.UNAVAILABLE  # a certificate of another CA
    with (
        grpc.insecure_channel(decode.grpc_address) as plain,
        pytest.raises(grpc.RpcError) as refused,
    ):
        decode_pb2_grpc.DecodeStub(plain).GetLoads(decode_pb2.GetLoadsRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_etcd_takes_only_the_mesh_certificate(mesh, tmp_path):
    assert mesh.etcd.endpoint.startswith("https://")
    plain = mesh.etcd.endpoint.removeprefix("https://")
    stranger = make_leaf(tmp_path / "other", "mesh", make_ca(tmp_path / "other", "another CA"))
    for endpoint, access in (
        (plain, EtcdAccess()),  # plaintext
        (mesh.etcd.endpoint, EtcdAccess(ca=mesh.tls.ca)),  # no client certificate
        (mesh.etcd.endpoint, EtcdAccess(mesh.tls.ca, stranger.cert, stranger.key)),  # other CA
    ):
        with pytest.raises(DiscoveryError):
            asyncio.run(asyncio.wait_for(list_workers(endpoint, "default", access), 20))


def test_kvmesh_status_reaches_etcd_with_the_mesh_certificate(mesh):
    command = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "status",
        "--etcd",
        mesh.etcd.endpoint,
        *mesh.tls.as_flags(),
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    roles = sorted(w["role"] for w in json.loads(done.stdout)["workers"])
    assert roles == ["decode", "prefill"]
    bare = subprocess.run(command[:6] + ["--json"], capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "--etcd-ca" in bare.stderr


def test_keys_and_prompts_never_reach_the_logs(mesh, base_url):
    secret_prompt = "my-secret-prompt-71d3"
    _openai(mesh, base_url, KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": secret_prompt}], max_tokens=2
    )
    logs = "".join(path.read_text(errors="replace") for path in mesh.run_dir.glob("*.log"))
    assert logs and KEY not in logs and OTHER_KEY not in logs and secret_prompt not in logs
