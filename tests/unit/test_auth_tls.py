"""API keys and TLS settings: keys from flags and a file (comments, blanks), checked in constant
time against digests; TLS files all or none; the throwaway CA's certificates chain to it."""

from __future__ import annotations

import os

import pytest
from cryptography import x509

from kvmesh.errors import AuthenticationError, InvalidRequestError
from kvmesh.mesh.certs import make_ca, make_leaf
from kvmesh.mesh.tls import TlsFiles
from services.gateway.auth import ApiKeys, presented_key


def test_keys_from_flags_and_file(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team a\nsk-a\n\n  sk-b  \n")
    keys = ApiKeys.of(["sk-flag"], str(keys_file))
    assert keys is not None
    for key in ("sk-flag", "sk-a", "sk-b"):
        keys.check({"authorization": f"Bearer {key}"})
    keys.check({"x-api-key": "sk-a"})
    with pytest.raises(AuthenticationError, match="incorrect"):
        keys.check({"authorization": "Bearer sk-c"})
    with pytest.raises(AuthenticationError, match="missing"):
        keys.check({})
    assert ApiKeys.of([], None) is None
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(InvalidRequestError, match="no API key"):
        ApiKeys.of([], str(empty))
    with pytest.raises(InvalidRequestError, match="does not exist"):
        ApiKeys.of([], str(tmp_path / "missing"))
    assert presented_key({"authorization": "bearer  sk-x "}) == "sk-x"


def test_tls_files_all_or_none_and_the_ca_signs_them(tmp_path):
    assert TlsFiles.of(None, None, None) is None
    with pytest.raises(InvalidRequestError, match="go together"):
        TlsFiles.of("cert.pem", None, None)
    ca = make_ca(tmp_path)
    files = make_leaf(tmp_path, "svc", ca, ("127.0.0.1", "decode.local"))
    assert TlsFiles.of(str(files.cert), str(files.key), str(files.ca)) == files
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    issuer = x509.load_pem_x509_certificate(ca[0].read_bytes())
    cert.verify_directly_issued_by(issuer)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "decode.local" in names.get_values_for_type(x509.DNSName)
    assert (files.key.stat().st_mode & 0o077) == 0  # the key is not readable by others
    with pytest.raises(InvalidRequestError, match="does not exist"):
        TlsFiles.of(str(files.cert), str(tmp_path / "nope.key"), str(files.ca))


def test_an_empty_key_is_refused_and_keys_come_from_the_environment(monkeypatch):
    with pytest.raises(InvalidRequestError, match="empty"):
        ApiKeys.of([""], None)
    monkeypatch.setenv("KVMESH_API_KEYS", "sk-env-1\n\nsk-env-2\n")
    keys = ApiKeys.of([], None)
    assert keys is not None and keys.allows("sk-env-2") and not keys.allows("sk-other")


def test_every_way_of_sending_a_key_salts_the_cache_per_key():
    from services.gateway.auth import tenant_salt

    bearer = tenant_salt({"authorization": "Bearer sk-a"})
    assert bearer == tenant_salt({"x-api-key": "sk-a"}) != tenant_salt({"x-api-key": "sk-b"})
    assert bearer.startswith("key:") and "sk-a" not in bearer and tenant_salt({}) == ""


def test_the_default_max_tokens_stays_within_the_configured_limit():
    from services.gateway.limits import RequestLimits
    from services.gateway.served import ServedModel, default_max_tokens

    served = ServedModel("m", 8192, limits=RequestLimits(max_output_tokens=64))
    assert default_max_tokens(10, served) == 64
    assert default_max_tokens(8190, served) == 2


def test_etcd_access_settings(tmp_path, monkeypatch):
    from kvmesh.cli_args import build_parser
    from kvmesh.mesh import etcd_access, tls
    from kvmesh.mesh.etcd_access import EtcdAccess

    files = make_leaf(tmp_path, "mesh", make_ca(tmp_path))
    plain = EtcdAccess().client("127.0.0.1:2379")
    assert (plain._host, plain._port, plain._credentials) == ("127.0.0.1", 2379, None)
    assert EtcdAccess().client("http://etcd.local:23790/")._port == 23790
    secure = EtcdAccess.of_mesh(files).client("https://10.0.0.5:2379")
    assert secure._host == "10.0.0.5" and secure._credentials is not None
    with pytest.raises(InvalidRequestError, match="not https"):
        EtcdAccess(ca=files.ca).client("127.0.0.1:2379")
    with pytest.raises(InvalidRequestError, match="expected host:port"):
        EtcdAccess().client("https://:x")
    with pytest.raises(InvalidRequestError, match="go together"):
        EtcdAccess(ca=files.ca, cert=files.cert)
    with pytest.raises(InvalidRequestError, match="KVMESH_ETCD_PASSWORD"):
        EtcdAccess(user="kvmesh")
    assert "secret" not in repr(EtcdAccess(user="kvmesh", password="secret"))
    monkeypatch.setenv("KVMESH_ETCD_PASSWORD", "pw")
    args = build_parser().parse_args(
        ["status", "--etcd-user", "kvmesh", "--etcd-ca", str(files.ca)]
    )
    etcd_access.configure_from(args)
    try:
        assert etcd_access.current() == EtcdAccess(ca=files.ca, user="kvmesh", password="pw")
        assert "KVMESH_ETCD_PASSWORD" not in os.environ  # children do not inherit it
        tls.configure(files)  # without --etcd-ca an https endpoint uses the mesh's files
        assert EtcdAccess().client("https://127.0.0.1:1")._credentials is not None
    finally:
        etcd_access.configure(EtcdAccess())
        tls.configure(None)


def test_a_client_salt_partitions_only_inside_its_own_key():
    """x-kvmesh-cache-salt scoped under the tenant: B sending A's salt (or A's derived salt)
    never reaches A's pages; one key's two client salts are apart; no key: the client's salt."""
    from services.gateway.auth import request_salt, tenant_salt
    from services.gateway.generation import Routing

    a, b = {"authorization": "Bearer sk-a"}, {"authorization": "Bearer sk-b"}
    salt = {"x-kvmesh-cache-salt": "s"}
    a_s, b_s = Routing.from_headers(a | salt).cache_salt, Routing.from_headers(b | salt).cache_salt
    assert a_s != b_s and a_s == Routing.from_headers(a | salt).cache_salt
    assert a_s != Routing.from_headers(a | {"x-kvmesh-cache-salt": "t"}).cache_salt
    forged = Routing.from_headers(b | {"x-kvmesh-cache-salt": tenant_salt(a)}).cache_salt
    assert forged not in (tenant_salt(a), Routing.from_headers(a).cache_salt)
    assert Routing.from_headers(a).cache_salt == tenant_salt(a)
    assert request_salt({}, "s") != request_salt({}, "") == ""
