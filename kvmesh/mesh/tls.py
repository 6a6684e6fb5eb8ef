"""TLS for the mesh's gRPC traffic, configured once per process (`configure`, from --tls-cert /
--tls-key / --tls-ca): every server then listens with TLS and every channel (`grpc_server
.channel`) dials with it, presenting this process's certificate: mutual TLS between services,
each side checking the other's certificate against the CA. A service facing clients (the
gateway's gRPC and REST front) serves TLS without asking clients for a certificate (API keys
authenticate them). Without `configure` everything stays plaintext (loopback, the default)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.errors import InvalidRequestError

if TYPE_CHECKING:  # grpc is imported where credentials are made: flag parsing stays light
    import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert: Path  # PEM certificate chain of this process
    key: Path  # its PEM private key
    ca: Path  # PEM bundle of the CA(s) every peer's certificate must chain to

    @classmethod
    def of(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """From the three flags: all or none (a clear error otherwise)."""
        given = [value for value in (cert, key, ca) if value]
        if not given:
            return None
        if len(given) != 3:
            raise InvalidRequestError("--tls-cert, --tls-key and --tls-ca go together")
        files = cls(Path(cert), Path(key), Path(ca))  # type: ignore[arg-type]
        for path in (files.cert, files.key, files.ca):
            if not path.is_file():
                raise InvalidRequestError(f"TLS file {path} does not exist")
        return files

    def server_credentials(self, client_certs: bool) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes(),
            require_client_auth=client_certs,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes(),
        )

    def as_flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def configure_from(args: argparse.Namespace) -> None:
    configure(
        TlsFiles.of(
            getattr(args, "tls_cert", None),
            getattr(args, "tls_key", None),
            getattr(args, "tls_ca", None),
        )
    )


_current: TlsFiles | None = None


def configure(files: TlsFiles | None) -> None:
    """This process's TLS (None: plaintext); called once at service start."""
    global _current
    _current = files


def current() -> TlsFiles | None:
    return _current
