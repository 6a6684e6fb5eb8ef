"""Where a service listens and what it tells its peers: the bind host (`--host`, which may be a
wildcard such as 0.0.0.0) and the advertised host (`--advertise-host`, default the bind host)
that goes into its etcd registration and its transfer engine's session. No torch, no grpc."""

from __future__ import annotations

import ipaddress

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})  # noqa: S104 - names, no bind


def is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False  # a name (resolved by whoever dials it)


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 literal in brackets ("[::1]:50051"), as gRPC and URLs want it."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if is_ipv6(bare) else f"{bare}:{port}"


def advertised(host: str, advertise_host: str = "", transfer: bool = False) -> str:
    """The host peers dial: `advertise_host`, else the bind `host`. A wildcard bind needs an
    advertised address; with a transfer engine it must not be IPv6 (Mooncake's handshake
    resolves peers by IPv4 only: "use IPv4 address instead", measured with 0.3.13). ValueError
    with the flag to change otherwise."""
    host, advertise_host = host.strip("[]"), advertise_host.strip("[]")
    public = advertise_host or host
    if advertise_host in WILDCARD_HOSTS - {""}:
        raise ValueError(f"--advertise-host {advertise_host} is no address a peer can dial")
    if public in WILDCARD_HOSTS:
        raise ValueError(
            f"--host {host or '(empty)'} listens on every interface, and peers need an address "
            "to dial: give --advertise-host (e.g. this machine's or pod's IP)"
        )
    if transfer and is_ipv6(public):
        raise ValueError(
            f"{public} is IPv6, and the transfer engine (Mooncake) reaches peers by IPv4 only: "
            "give an IPv4 --advertise-host (or --host)"
        )
    return public
