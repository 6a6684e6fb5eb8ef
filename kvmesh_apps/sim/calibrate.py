"""Fit the linear cost model to a live mesh, and check the simulator against it.

`calibrate` starts a mesh (1 prefill + 1 decode worker, every prompt through the prefill
worker), times lone prompts of several lengths (TTFT) and concurrent streams at several batch
sizes and prompt lengths (TPOT), and fits: decode TPOT = base + per_row' * rows + per_context *
context (per_row' = per_row + per_token); TTFT = a + per_token * n + per_pair * n^2 / 2, with
a = base + 4 hops (gateway -> decode -> prefill -> decode -> gateway). KV transfer time is
folded into per_token (one loopback host). The workers share this machine's CPUs: a decode
step beside a prefill step (and back) is slower, by factors timed with streams and prompts side
by side (`shared_slowdown`), and the last token's lateness (`finish_s`: every chunk but the
last goes on the delivery stream right after its step, the last one on the Generate call,
through the worker's event loop). `check` sends a small agent workload to the mesh
and to the simulator with the fitted model and the mesh's own pool size.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

import grpc
import numpy as np

from kvmesh.config import SchedulerConfig
from kvmesh.mesh.launcher import Mesh, UpOptions, list_workers
from kvmesh.mesh.up_config import gateway_config, worker_configs
from kvmesh.mesh.worker_info import WorkerInfo
from kvmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh_apps.sim.cost import LinearCost
from kvmesh_apps.sim.gateway import Record
from kvmesh_apps.sim.mesh_run import MeshClient, run_sessions
from kvmesh_apps.sim.presets import Preset, WorkerSpec

PREFILL_LENGTHS = (32, 96, 256, 512, 1024)
DECODE_BATCHES = (1, 4, 8)
# An untimed calibration (its times are not compared): still enough points for each fit
QUICK_PREFILL_LENGTHS = (32, 96, 256, 512)
QUICK_DECODE_BATCHES = (1, 8)
DECODE_LENGTHS = (64, 512)
DECODE_TOKENS = 32
SUFFIX = 8  # a batch's streams share a cached prefix: each has this many tokens of its own
CONTENDED = (4, 64, 48)  # streams, their shared prefix and output tokens
BESIDE = (512, 96)  # prompts computed beside them: long ones (decode's slowdown), short ones


@dataclass(frozen=True)
class MeshSetup:
    model: str = "smollm2-135m"
    kv_cache_mib: int = 128
    max_num_seqs: int = 16
    routing: str = "cache-aware"

    def options(self, decode: int = 1) -> UpOptions:
        return UpOptions(
            workers=worker_configs(
                "--model",
                self.model,
                "--kv-cache-mib",
                str(self.kv_cache_mib),
                "--max-num-seqs",
                str(self.max_num_seqs),
                "--local-prefill-tokens",
                "0",
            ),
            prefill=1,
            decode=decode,
            gateway=gateway_config("--routing", self.routing),
        )


@contextlib.contextmanager
def mesh_for(setup: MeshSetup, decode: int = 1) -> Iterator[Mesh]:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    mesh = Mesh(setup.options(decode))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


@dataclass(frozen=True)
class Probes:
    prefill: list[tuple[int, float]]  # (prompt tokens, TTFT s)
    decode: list[tuple[int, int, float]]  # (streams, prompt tokens, TPOT s)
    decode_beside_prefill: float  # TPOT of CONTENDED streams while BESIDE[0] prompts compute
    prefill_beside_decode: float  # TTFT of BESIDE[1]-token prompts while such streams decode
    finish_s: float = 0.0  # how much later than a step the last token arrives


async def model_info(address: str) -> gateway_pb2.GetModelInfoResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        return await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=30)


async def probe(
    address: str, vocab: int, reps: int = 2, seed: int = 1, quick: bool = False
) -> Probes:
    """Prompts of fresh random tokens (nothing cached), one at a time; then streams in batches
    (a shared, cached prefix and SUFFIX tokens of their own: they start together); then streams
    and prompts side by side. `quick`: fewer lengths and batches (QUICK_*)."""
    lengths = QUICK_PREFILL_LENGTHS if quick else PREFILL_LENGTHS
    batches = QUICK_DECODE_BATCHES if quick else DECODE_BATCHES
    rng = random.Random(seed)
    fresh = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    async with MeshClient(address) as client:
        for _ in range(2):  # warm-up
            await client.generate(fresh(64), 4)
        prefill = []
        for n in lengths * reps:
            record, _ = await client.generate(fresh(n), 1)
            prefill.append((n, record.ttft_s))
        decode, finish = [], []
        for batch in batches:
            for length in DECODE_LENGTHS:
                runs = await asyncio.gather(
                    *await _streams(client, fresh, batch, length, DECODE_TOKENS)
                )
                decode.append((batch, length, statistics.median(_steady(r) for r, _ in runs)))
                finish += [_last_gap(r) - _steady(r) for r, _ in runs]
        beside_prefill, beside_decode = await _contended(client, fresh)
    return Probes(prefill, decode, beside_prefill, beside_decode, statistics.median(finish))


async def _streams(
    client: MeshClient,
    fresh,
    batch: int,
    length: int,
    tokens: int,
    started: list[asyncio.Event] | None = None,
) -> list:
    """`batch` stream calls (not awaited) whose prompts share a `length`-token prefix, computed
    once first: each then has only SUFFIX tokens to prefill."""
    prefix = fresh(length)
    await client.generate([*prefix, *fresh(SUFFIX)], 1)
    events = started or [None] * batch
    return [client.generate([*prefix, *fresh(SUFFIX)], tokens, first=event) for event in events]


def _steady(record: Record) -> float:
    """Time per token up to the last one (which takes the slower path: `finish_s`)."""
    times = record.token_times
    return (times[-2] - times[0]) / (len(times) - 2)


def _last_gap(record: Record) -> float:
    return record.token_times[-1] - record.token_times[-2]


async def _contended(client: MeshClient, fresh) -> tuple[float, float]:
    """(TPOT of streams while long prompts are computed back to back, median TTFT of short
    prompts sent back to back while such streams decode)."""
    tpot, _ = await _beside(client, fresh, BESIDE[0])
    _, ttft = await _beside(client, fresh, BESIDE[1])
    return tpot, ttft


async def _beside(client: MeshClient, fresh, prompt: int) -> tuple[float, float]:
    streams, length, tokens = CONTENDED
    started = [asyncio.Event() for _ in range(streams)]
    calls = await _streams(client, fresh, streams, length, tokens, started)
    runs = [asyncio.ensure_future(call) for call in calls]
    for event in started:
        await event.wait()
    ttfts = []
    while not all(run.done() for run in runs):
        record, _ = await client.generate(fresh(prompt), 1)
        ttfts.append(record.ttft_s)
    return statistics.median([_steady((await run)[0]) for run in runs]), statistics.median(ttfts)


def fit(probes: Probes, source: str) -> LinearCost:
    d = np.array([[1.0, b, b * (n + SUFFIX + DECODE_TOKENS / 2)] for b, n, _ in probes.decode])
    base, row, context = np.linalg.lstsq(d, np.array([t for *_, t in probes.decode]), None)[0]
    # relative errors: short prompts (most of an agent's turns) fit as well as long ones
    weight = np.array([1 / t for _, t in probes.prefill])
    p = np.array([[1.0, n, n * n / 2] for n, _ in probes.prefill]) * weight[:, None]
    a, token, pair = np.linalg.lstsq(p, np.array([t for _, t in probes.prefill]) * weight, None)[0]
    base, row, token, pair, context = (
        max(0.0, float(v)) for v in (base, row, token, pair, context)
    )
    finish = max(0.0, probes.finish_s)
    rpc = max(0.0, (float(a) - base - finish) / 4)  # a 1-token reply's token is its last
    streams, length, tokens = CONTENDED
    alone_step = base + row * streams + context * streams * (length + SUFFIX + tokens / 2)
    decode_slowdown = max(0.0, probes.decode_beside_prefill / alone_step - 1)
    prompt = BESIDE[1]
    alone_prompt = base + token * prompt + pair * prompt * prompt / 2
    # beside decoding streams, a prompt also waits for the decode engine twice (the reserve
    # and the commit, each half a step on average): the simulator models those waits itself
    waits = alone_step * (1 + decode_slowdown)
    stepped = probes.prefill_beside_decode - 4 * rpc - finish - waits
    return LinearCost(
        name="fitted",
        base_s=base,
        per_token_s=token,
        per_row_s=row,
        per_context_s=context,
        per_pair_s=pair,
        transfer_page_s=0.0,
        rpc_s=rpc,
        finish_s=finish,
        decode_slowdown=decode_slowdown,
        prefill_slowdown=max(0.0, stepped / alone_prompt - 1),
        source=source,
    )


async def worker_spec(
    mesh: Mesh, setup: MeshSetup, max_model_len: int
) -> tuple[WorkerSpec, WorkerInfo]:
    """The pool and limits of the mesh's decode worker (its pages from GetLoads; the context
    length from the gateway's GetModelInfo, which the caller has)."""
    from kvmesh.mesh.grpc_server import channel
    from kvmesh.proto.v1 import decode_pb2, decode_pb2_grpc

    workers = await list_workers(mesh.etcd.endpoint, mesh.options.cluster)
    decode = next(w for w in workers if w.role == "decode")
    async with channel(decode.grpc_address) as ch:
        loads = await decode_pb2_grpc.DecodeStub(ch).GetLoads(decode_pb2.GetLoadsRequest())
    spec = WorkerSpec(
        loads.loads[0].kv_pages_total,
        decode.page_size,
        setup.max_num_seqs,
        SchedulerConfig.max_num_batched_tokens,
        max_model_len,
    )
    return spec, decode


def preset_json(preset: Preset) -> dict:
    """What `load_preset(FILE)` reads back."""
    return {
        "kind": "linear",
        **asdict(preset.cost),
        "worker": asdict(preset.worker),
        "mesh": {"model": preset.model, "kv_dtype": preset.kv_dtype},
    }


def fitted(cost: LinearCost, spec: WorkerSpec, info: WorkerInfo) -> Preset:
    return Preset(cost, spec, info.model, info.kv_dtype, shared_host=True)


async def calibrate_on(mesh: Mesh, setup: MeshSetup, source: str, timed: bool = True) -> Preset:
    """Probe the running mesh, fit, then tune the slowdowns on an agent workload run on it
    (tune.py): its fitted preset (cost, the decode worker's pool). Not `timed` (its times are
    not compared): fewer probes, each once, no tuning."""
    from kvmesh_apps.sim.tune import TUNE_WORKLOAD, tune

    address = f"127.0.0.1:{mesh.grpc_port}"
    info = await model_info(address)
    probes = await probe(address, info.vocab_size, reps=2 if timed else 1, quick=not timed)
    spec, worker = await worker_spec(mesh, setup, info.max_model_len)
    if not timed:
        return fitted(fit(probes, source), spec, worker)
    workload = replace(TUNE_WORKLOAD, vocab=info.vocab_size)
    measured = await run_sessions(address, workload.build())
    return tune(fitted(fit(probes, source), spec, worker), workload, measured)
