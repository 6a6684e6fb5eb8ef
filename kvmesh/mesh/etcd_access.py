"""How a process reaches etcd: plaintext (`host:port`, the loopback default), or TLS (an
`https://host:port` endpoint: etcd's certificate checked against a CA, this process's certificate
presented for etcd's `--client-cert-auth`), and etcd's own user / password authentication as an
option (`--etcd-user`, the password from KVMESH_ETCD_PASSWORD: never on a command line).

Without `--etcd-ca` an https endpoint uses the mesh's `--tls-*` files (`kvmesh up --tls` signs
etcd's certificate with the mesh's CA). Configured once per process like `tls`;
`discovery.Registry` makes its client here. aetcd dials only plaintext, so `EtcdClient` opens the
channel itself (etcd_client.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from kvmesh import env
from kvmesh.errors import InvalidRequestError
from kvmesh.mesh import tls

log = structlog.get_logger(__name__)

if TYPE_CHECKING:  # grpc and aetcd are imported where a client is made: flag parsing stays light
    import grpc

    from kvmesh.mesh.etcd_client import EtcdClient


@dataclass(frozen=True)
class EtcdAccess:
    ca: Path | None = None  # the CA etcd's certificate must chain to (None: the mesh's)
    cert: Path | None = None  # this process's client certificate (with key)
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidRequestError("--etcd-cert and --etcd-key go together")
        if (self.cert is not None or self.key is not None) and self.ca is None:
            raise InvalidRequestError("--etcd-cert / --etcd-key need --etcd-ca")
        if self.user is not None and not self.password:
            raise InvalidRequestError(f"--etcd-user needs the password in {env.ETCD_PASSWORD_ENV}")
        for path in (self.ca, self.cert, self.key):
            if path is not None and not path.is_file():
                raise InvalidRequestError(f"etcd TLS file {path} does not exist")

    @classmethod
    def of_mesh(
        cls, files: tls.TlsFiles, user: str | None = None, password: str | None = None
    ) -> EtcdAccess:
        """Reach etcd with the mesh's own certificate (what `kvmesh up --tls` does)."""
        return cls(files.ca, files.cert, files.key, user, password)

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials for an https endpoint: these files, each else the mesh's."""
        import grpc

        ca, cert, key, mesh = self.ca, self.cert, self.key, tls.current()
        if ca is None and mesh is None:
            raise InvalidRequestError("an https etcd endpoint needs --etcd-ca (or --tls-* files)")
        if mesh is not None:
            ca = ca or mesh.ca
            cert, key = (cert, key) if cert is not None else (mesh.cert, mesh.key)
        assert ca is not None
        return grpc.ssl_channel_credentials(
            root_certificates=ca.read_bytes(),
            private_key=key.read_bytes() if key else None,
            certificate_chain=cert.read_bytes() if cert else None,
        )

    def client(self, endpoint: str, **kwargs: Any) -> EtcdClient:
        """A client of `endpoint` (`host:port`, `http://host:port` or `https://host:port`)."""
        scheme, sep, rest = endpoint.partition("://")
        if not sep:
            scheme, rest = "http", endpoint
        if scheme not in ("http", "https"):
            raise InvalidRequestError(f"etcd endpoint {endpoint!r}: expected http:// or https://")
        if scheme == "http" and self.ca is not None:
            raise InvalidRequestError(
                f"--etcd-ca given but etcd endpoint {endpoint!r} is not https://"
            )
        host, _, port = rest.rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRequestError(f"etcd endpoint {endpoint!r}: expected host:port")
        from kvmesh.mesh.etcd_client import EtcdClient

        credentials = self.credentials() if scheme == "https" else None
        if credentials is None and self.user is not None:
            log.warning("etcd.password_in_clear", endpoint=endpoint, hint="use https://")
        return EtcdClient(host, int(port), credentials, self.user, self.password, **kwargs)


def configure_from(args: argparse.Namespace) -> None:
    def path(name: str) -> Path | None:
        value = getattr(args, name, None)
        return Path(value) if value else None

    user = getattr(args, "etcd_user", None) or None
    configure(
        EtcdAccess(
            path("etcd_ca"),
            path("etcd_cert"),
            path("etcd_key"),
            user,
            env.take_etcd_password() if user else None,
        )
    )


_current = EtcdAccess()


def configure(access: EtcdAccess) -> None:
    """This process's way to etcd; called once at start."""
    global _current
    _current = access


def current() -> EtcdAccess:
    return _current
