"""aetcd's client over TLS: aetcd 1.0 dials only plaintext, so `EtcdClient.connect` opens the
channel itself (secure where credentials are given) and logs in with etcd's user / password
where one is set. etcd keeps auth tokens in memory: after a restart it rejects ours; the calls
discovery makes then log in again and are retried once (a watch breaks and is made again).
EtcdClient relies on internals of aetcd 1.0 (pinned in pyproject.toml)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher
from aetcd.exceptions import InvalidArgumentError, UnauthenticatedError


def _token_stale(error: aetcd.ClientError) -> bool:
    """etcd no longer takes our token: it forgot it (a restart, UNAUTHENTICATED), or its users
    and roles changed since we logged in ("auth store is old", INVALID_ARGUMENT)."""
    return isinstance(error, UnauthenticatedError) or (
        isinstance(error, InvalidArgumentError) and "auth store is old" in str(error)
    )


class _Watcher(watcher.Watcher):
    """aetcd's watcher, except that a watch etcd creates already cancelled (what it answers to a
    stale token or a missing permission, in the reply rather than as an error) fails instead of
    waiting for events that never come."""

    async def _handle_response(self, response: Any) -> None:
        if not (response.created and response.canceled):
            await super()._handle_response(response)
            return
        async with self._lock:
            if self._new_callback is not None:
                reason = response.cancel_reason or "etcd refused the watch"
                self._new_callback.error = UnauthenticatedError(reason)
                self._new_callback_ready.notify_all()


def _logged_in(name: str) -> Callable[..., Awaitable[Any]]:
    """aetcd's method `name`, called once more after logging in again when etcd has forgotten
    our token."""
    method = getattr(aetcd.Client, name)

    async def call(self: EtcdClient, *args: Any, **kwargs: Any) -> Any:
        generation = self._generation
        try:
            return await method(self, *args, **kwargs)
        except aetcd.ClientError as error:
            if self._username is None or not _token_stale(error):
                raise
        async with self._login_lock:
            if generation == self._generation:  # nobody logged in again since that call began
                await self._login_again()
        return await method(self, *args, **kwargs)

    return call


class EtcdClient(aetcd.Client):
    """aetcd's client over a TLS channel where credentials are given."""

    def __init__(
        self,
        host: str,
        port: int,
        credentials: grpc.ChannelCredentials | None,
        user: str | None,
        password: str | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(host=host, port=port, username=user, password=password, **kwargs)
        self._credentials = credentials
        self._generation = 0  # logins so far (a failed call logs in again only once)
        self._login_lock = asyncio.Lock()

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            target, options = f"{self._host}:{self._port}", list(self._options.items())
            if self._credentials is None:
                self.channel = grpc.aio.insecure_channel(target, options=options)
            else:
                self.channel = grpc.aio.secure_channel(target, self._credentials, options=options)
            if self._username is not None:
                try:
                    self.metadata = (("token", await self._authenticate()),)
                except BaseException:  # (a cancelled login too: no channel left open)
                    await self.channel.close()
                    self._init_channel_attrs()
                    raise
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = _Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False

    async def _authenticate(self) -> str:
        assert self.channel is not None
        request = rpc.AuthenticateRequest(name=self._username, password=self._password)
        try:
            reply = await rpc.AuthStub(self.channel).Authenticate(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise aetcd.ConnectionFailedError(e.details()) from e
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise aetcd.ConnectionTimeoutError(e.details()) from e
            raise UnauthenticatedError(f"etcd authentication failed: {e.details()}") from e
        return reply.token

    async def _login_again(self) -> None:
        """A fresh token on the same channel (closing it would cancel other tasks' calls); the
        watcher, which holds the token of its stream, is replaced: its watches end and are
        made again by their owners."""
        await self.connect()
        self.metadata = (("token", await self._authenticate()),)
        self._generation += 1
        old, self._watcher = (
            self._watcher,
            _Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata),
        )
        if old is not None:
            await old.shutdown()

    # The calls discovery makes (a watch_prefix is a watch, Lease.refresh / revoke the lease ones).
    get = _logged_in("get")
    get_prefix = _logged_in("get_prefix")
    put = _logged_in("put")
    watch = _logged_in("watch")
    lease = _logged_in("lease")
    refresh_lease = _logged_in("refresh_lease")
    revoke_lease = _logged_in("revoke_lease")
