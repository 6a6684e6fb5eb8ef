"""`python -m kvmesh_apps.benchmarks.transfer`: KV pages into another process, TE write vs gRPC.

One run, one target process (multiprocessing "spawn") that owns a KV-shaped page pool, registers
it with a Mooncake Transfer Engine and also serves gRPC on a free 127.0.0.1 port. For N scattered
pages of `page_bytes` each (default 368640 = one SmolLM2-135M fp32 page) the parent measures the
median wall time of:
- te: `KvTransferEngine.write_pages` (one batch write into the peer's registered pool);
- grpc: gather the pages into one protobuf `bytes` field plus the destination page ids, a unary
  call, the server copies them into its pool. This is the path TE replaces.
Both sides use one torch thread. The destination pages are checked by digest after each method.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent import futures
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kvmesh.log import configure_logging
from kvmesh.mesh.transfer import KvTransferEngine, page_segments

SERVICE = "kvmesh.bench.v1.PageSink"
METHOD = f"/{SERVICE}/Write"
MAX_MESSAGE = 1 << 30
SMOLLM2_FP32_PAGE_BYTES = 368640  # 2 (k|v) * 30 layers * 16 slots * 3 heads * 64 dim * 4 bytes


def _message_classes() -> tuple[type, type]:
    """Bench-only messages, built at runtime so the bench needs no generated code:

    PageWrite { bytes data = 1;  // the pages, concatenated
                repeated int64 page_ids = 2; }  // destination page of each
    PageWriteReply { int64 bytes_written = 1; }
    """
    fdp = descriptor_pb2.FileDescriptorProto(
        name="kvmesh/bench/v1/page_sink.proto", package="kvmesh.bench.v1", syntax="proto3"
    )
    F = descriptor_pb2.FieldDescriptorProto
    req = fdp.message_type.add(name="PageWrite")
    req.field.add(name="data", number=1, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    req.field.add(name="page_ids", number=2, type=F.TYPE_INT64, label=F.LABEL_REPEATED)
    rep = fdp.message_type.add(name="PageWriteReply")
    rep.field.add(name="bytes_written", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    file = descriptor_pool.DescriptorPool().Add(fdp)
    types = file.message_types_by_name
    return (
        message_factory.GetMessageClass(types["PageWrite"]),
        message_factory.GetMessageClass(types["PageWriteReply"]),
    )


def _digest(pages: np.ndarray, ids: list[int]) -> str:
    return hashlib.blake2b(pages[ids].tobytes(), digest_size=16).hexdigest()


# ---- target process -------------------------------------------------------------------------


def _start_grpc(pages: np.ndarray) -> tuple[grpc.Server, int]:
    request_cls, reply_cls = _message_classes()

    def write(request: Any, context: grpc.ServicerContext) -> Any:
        ids = list(request.page_ids)
        pages[ids] = np.frombuffer(request.data, dtype=np.uint8).reshape(len(ids), -1)
        return reply_cls(bytes_written=len(request.data))

    handler = grpc.unary_unary_rpc_method_handler(
        write,
        request_deserializer=request_cls.FromString,
        response_serializer=reply_cls.SerializeToString,
    )
    options = [("grpc.max_receive_message_length", MAX_MESSAGE)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Write": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _serve(num_pages: int, page_bytes: int, conn: Connection) -> None:
    """Target: own the pool, serve TE and gRPC, answer digest/zero/stop commands on `conn`."""
    configure_logging("transfer-bench-target")
    torch.set_num_threads(1)
    pool = torch.zeros(num_pages, page_bytes, dtype=torch.uint8)
    pages = pool.numpy()
    engine = KvTransferEngine()
    engine.register(pool.data_ptr(), pool.numel())
    server, port = _start_grpc(pages)
    conn.send((engine.session, pool.data_ptr(), port))
    try:
        while (command := conn.recv())[0] != "stop":
            if command[0] == "digest":
                conn.send(_digest(pages, command[1]))
            elif command[0] == "zero":
                pool.zero_()
                conn.send(None)
    finally:
        server.stop(grace=None)
        engine.close()


# ---- initiator --------------------------------------------------------------------------------


def _median_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class _Bench:
    """The parent's side: a source pool, a local TE and a gRPC stub aimed at the target."""

    def __init__(self, num_pages: int, page_bytes: int, target: tuple[str, int, int]) -> None:
        self.page_bytes = page_bytes
        self.pool = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8)
        self.session, self.remote_pool, grpc_port = target
        self.engine = KvTransferEngine()
        self.engine.register(self.pool.data_ptr(), self.pool.numel())
        options = [("grpc.max_send_message_length", MAX_MESSAGE)]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
        request_cls, reply_cls = _message_classes()
        self.request_cls = request_cls
        self.call = self.channel.unary_unary(
            METHOD,
            request_serializer=request_cls.SerializeToString,
            response_deserializer=reply_cls.FromString,
        )

    def te_write(self, src: list[int], dst: list[int]) -> None:
        self.engine.write_pages(
            self.session,
            page_segments(self.pool.data_ptr(), self.page_bytes, src),
            page_segments(self.remote_pool, self.page_bytes, dst),
            self.page_bytes,
        )

    def grpc_write(self, src: list[int], dst: list[int]) -> None:
        data = self.pool[src].numpy().tobytes()
        reply = self.call(self.request_cls(data=data, page_ids=dst), timeout=60)
        if reply.bytes_written != len(data):
            raise RuntimeError(f"gRPC target wrote {reply.bytes_written} of {len(data)} bytes")

    def close(self) -> None:
        self.channel.close()
        self.engine.close()


def _check(conn: Connection, bench: _Bench, src: list[int], dst: list[int], method: str) -> None:
    conn.send(("digest", dst))
    if conn.recv() != _digest(bench.pool.numpy(), src):
        raise RuntimeError(f"{method}: destination pages differ from the source pages")


def _bench_row(conn: Connection, bench: _Bench, n: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(n)
    num_pages = bench.pool.shape[0]
    src = torch.randperm(num_pages, generator=gen)[:n].tolist()
    dst = torch.randperm(num_pages, generator=gen)[:n].tolist()
    row: dict[str, Any] = {"pages": n, "bytes": n * bench.page_bytes}
    for method, fn in (("te", bench.te_write), ("grpc", bench.grpc_write)):
        conn.send(("zero",))
        conn.recv()
        ms = _median_ms(lambda fn=fn: fn(src, dst), args.warmup, args.repeats)
        _check(conn, bench, src, dst, method)
        row[f"{method}_ms"] = round(ms, 3)
        row[f"{method}_mb_s"] = round(row["bytes"] / ms / 1e3, 1)
    row["te_over_grpc"] = round(row["te_mb_s"] / row["grpc_mb_s"], 2)
    return row


def measure(args: argparse.Namespace) -> dict:
    """Run every page count against one target process; returns the report."""
    counts = [int(c) for c in args.pages.split(",")]
    num_pages = 2 * max(counts)
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(num_pages, args.page_bytes, child), daemon=True)
    proc.start()
    bench = None
    try:
        if not parent.poll(60):
            raise RuntimeError("transfer bench target did not start within 60 s")
        bench = _Bench(num_pages, args.page_bytes, parent.recv())
        rows = [_bench_row(parent, bench, n, args) for n in counts]
    finally:
        if bench is not None:
            bench.close()
        _stop(proc, parent)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "page_bytes": args.page_bytes,
        "repeats": args.repeats,
        "rows": rows,
    }


def _stop(proc: mp.process.BaseProcess, conn: Connection) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):
        conn.send(("stop",))
    proc.join(timeout=5)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    conn.close()


def markdown(report: dict) -> str:
    lines = [
        f"KV page write into another process, page {report['page_bytes']} B, "
        f"median of {report['repeats']} ({report['machine']})",
        "",
        "| pages | MB | TE ms | TE MB/s | gRPC ms | gRPC MB/s | TE/gRPC |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['pages']} | {r['bytes'] / 1e6:.1f} | {r['te_ms']:.2f} | {r['te_mb_s']:.0f} "
            f"| {r['grpc_ms']:.2f} | {r['grpc_mb_s']:.0f} | {r['te_over_grpc']:.1f}x |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", default="8,32,128", help="comma-separated page counts")
    parser.add_argument("--page-bytes", type=int, default=SMOLLM2_FP32_PAGE_BYTES)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per cell")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", default=None, help="also write the JSON report here")


def run_transfer_bench(args: argparse.Namespace) -> int:
    report = measure(args)
    print(markdown(report))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh_apps.benchmarks.transfer", description=__doc__
    )
    add_arguments(parser)
    configure_logging("transfer-bench")
    return run_transfer_bench(parser.parse_args(argv))


if __name__ == "__main__":
    # Re-import under the package name so the spawned child unpickles `_serve` from there.
    from kvmesh_apps.benchmarks import transfer

    raise SystemExit(transfer.main())
