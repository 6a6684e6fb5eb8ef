"""`kvmesh sim`: the clock, step shapes, the request path's timing, real eviction, the policies
side by side, the fit, and the command line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.scheduler import Scheduler, SchedulerLimits
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.kv import BlockHasher, BlockManager, BlockManagerConfig
from kvmesh.errors import InvalidRequestError
from kvmesh.routing.router import (
    AffinityPolicy,
    LeastTokensPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    make_router,
)
from kvmesh_apps.sim.calibrate import BESIDE, CONTENDED, DECODE_TOKENS, SUFFIX, Probes, fit
from kvmesh_apps.sim.clock import Clock
from kvmesh_apps.sim.cost import LinearCost, StepShape
from kvmesh_apps.sim.fleet import Fleet, simulate
from kvmesh_apps.sim.presets import Preset, WorkerSpec, load_preset
from kvmesh_apps.sim.report import percentile, summarize
from kvmesh_apps.sim.workload import AgentWorkload, ChatWorkload

COST = LinearCost(
    "test",
    base_s=0.01,
    per_token_s=0.001,
    per_row_s=0.0005,
    per_context_s=1e-6,
    per_pair_s=0.0,
    transfer_page_s=0.0002,
    rpc_s=0.003,
)
SPEC = WorkerSpec(kv_pages=400, page_size=16, max_num_seqs=16, max_num_batched_tokens=512)
PRESET = Preset(COST, SPEC, "m", "fp32")


def test_clock_runs_in_time_order_ties_in_order_set():
    clock, seen = Clock(), []
    clock.at(2.0, seen.append, "c")
    clock.at(1.0, seen.append, "a")
    clock.at(1.0, seen.append, "b")
    clock.after(0.5, lambda: clock.after(1.0, seen.append, "after"))
    clock.run(until=1.6)
    assert seen == ["a", "b", "after"] and clock.now == 1.6
    clock.run()
    assert seen[-1] == "c"
    with pytest.raises(ValueError):
        clock.at(0.0, seen.append, "past")


def test_step_shape_of_a_real_schedule():
    pool = BlockManager(BlockManagerConfig(64, 4), BlockHasher.salted("m", 4, "fp32"))
    scheduler = Scheduler(SchedulerLimits(8, 10, 256), pool, frozenset())
    scheduler.add(Sequence("a", list(range(1, 7)), SamplingParams(max_tokens=4, ignore_eos=True)))
    first = scheduler.schedule()
    assert StepShape.of(first) == StepShape(6, 0, 0, 6, 6 * (0 + 7 / 2))
    scheduler.update(first, {"a": [9]})
    scheduler.add(Sequence("b", list(range(20, 32)), SamplingParams(max_tokens=4)))
    second = scheduler.schedule()  # a decodes (7 tokens of context), b's first 9 of 12
    assert StepShape.of(second) == StepShape(10, 1, 7, 9, 9 * (0 + 10 / 2))


def test_round_robin_and_make_router():
    from kvmesh.mesh.kv_events import PrefixIndex
    from kvmesh.mesh.worker_info import WorkerInfo
    from kvmesh.routing.prefix import PrefixLookup

    workers = [WorkerInfo("decode", f"d{i}", f"x:{i}") for i in range(3)]
    lookup = PrefixLookup(PrefixIndex())
    router = make_router(lambda role: workers, "round-robin", lookup)
    with router.holding("d0", 10_000):  # load is ignored
        assert [router.pick("decode", 1).worker.worker_id for _ in range(4)] == [
            "d0",
            "d1",
            "d2",
            "d0",
        ]
    assert isinstance(make_router(lambda r: [], "cache-aware", lookup).policy, AffinityPolicy)
    assert isinstance(make_router(lambda r: [], "prefix-aware", lookup).policy, PrefixAwarePolicy)
    least = make_router(lambda r: [], "least-load", lookup)
    assert isinstance(least.policy, LeastTokensPolicy) and least.prefix is None
    assert isinstance(make_router(lambda r: [], "round-robin", lookup).policy, RoundRobinPolicy)
    with pytest.raises(ValueError, match="unknown routing"):
        make_router(lambda r: [], "random", lookup)


def test_a_lone_request_takes_exactly_the_path_it_should():
    """Gateway -> decode (reserve) -> prefill (compute, hand over) -> decode (commit) ->
    gateway: four hops, one prefill step, the transfer of every page; then one decode step a
    token, each reading one more token of context."""
    session = AgentWorkload(
        sessions=1, turns=1, system_tokens=40, message_tokens=20, reply_tokens=5
    ).build()
    prompt = len(session[0].prompt())
    run = simulate(Fleet(1, 1), PRESET, session)
    [record] = run.records
    pages = -(-prompt // 16)
    prefill = COST.base_s + COST.per_token_s * prompt
    assert record.ttft_s == pytest.approx(4 * COST.rpc_s + prefill + pages * COST.transfer_page_s)
    steps = [COST.base_s + COST.per_row_s + COST.per_context_s * (prompt + i) for i in range(1, 5)]
    assert record.token_times[-1] - record.token_times[0] == pytest.approx(sum(steps))
    assert record.cached_tokens == 0 and record.prefill == "prefill-0" and not record.error


def test_every_request_completes_and_the_pools_are_consistent():
    sessions = AgentWorkload(
        sessions=12,
        turns=3,
        system_tokens=200,
        message_tokens=40,
        reply_tokens=8,
        think_s=0.1,
        start_s=0.5,
    ).build()
    run = simulate(Fleet(2, 2), PRESET, sessions)
    assert len(run.records) == 36 and not any(r.error for r in run.records)
    assert all(len(r.token_times) == 8 for r in run.records)
    for worker in run.workers:
        worker.pool.check_integrity()
        assert worker.pool.num_used_pages == 0  # every page freed (kept ones released)
        assert not worker.scheduler.has_unfinished()


def test_small_pools_evict_for_real_and_the_index_follows():
    sessions = AgentWorkload(
        sessions=16,
        turns=4,
        system_tokens=256,
        systems=4,
        message_tokens=64,
        reply_tokens=8,
        think_s=0.2,
        start_s=1.0,
    ).build()
    roomy = summarize(simulate(Fleet(1, 2), PRESET, sessions))
    small = replace(PRESET, worker=replace(SPEC, kv_pages=120))
    run = simulate(
        Fleet(1, 2),
        small,
        AgentWorkload(
            sessions=16,
            turns=4,
            system_tokens=256,
            systems=4,
            message_tokens=64,
            reply_tokens=8,
            think_s=0.2,
            start_s=1.0,
        ).build(),
    )
    tight = summarize(run)
    assert tight.hit_ratio < roomy.hit_ratio - 0.1
    stored = {h for r in sessions for h in _page_hashes(r.history)}  # every page ever computed
    index = run.workers[0].index
    for worker in run.workers:  # evictions reached the router's index
        held = worker.pool.cached_hashes()
        assert all(index.matched_pages(worker.worker_id, [h]) == 1 for h in held)
        assert len(held) < 0.5 * len(stored)
        # beyond what the pool holds: hashes `Router.prefilled` added ahead of the KV events
        # after the pages had gone (the real gateway does the same: stale until stored again)
        assert index.size(worker.worker_id) - len(held) <= 0.25 * len(held)


def test_cache_aware_routing_hits_more_than_load_blind_routing():
    sessions = lambda: AgentWorkload(  # noqa: E731
        sessions=24,
        turns=5,
        system_tokens=512,
        systems=2,
        message_tokens=96,
        reply_tokens=16,
        think_s=0.5,
        start_s=2.0,
    ).build()
    hit = {
        r: summarize(simulate(Fleet(0, 4, r), PRESET, sessions())).hit_ratio
        for r in ("cache-aware", "prefix-aware", "least-load", "round-robin")
    }
    assert hit["cache-aware"] > hit["least-load"] + 0.05
    assert hit["prefix-aware"] > hit["least-load"]
    assert hit["round-robin"] < hit["cache-aware"]


def test_colocated_workers_compute_prompts_beside_their_decodes():
    sessions = ChatWorkload(
        rate=20, duration_s=2.0, prefix_tokens=64, templates=2, prompt_tokens=300, reply_tokens=16
    ).build()
    colocated = summarize(simulate(Fleet(0, 2, "least-load"), PRESET, sessions))
    run = simulate(
        Fleet(1, 1, "least-load"),
        PRESET,
        ChatWorkload(
            rate=20,
            duration_s=2.0,
            prefix_tokens=64,
            templates=2,
            prompt_tokens=300,
            reply_tokens=16,
        ).build(),
    )
    few = ChatWorkload(rate=20, duration_s=0.2).build()
    assert all(r.prefill == "" for r in simulate(Fleet(0, 2), PRESET, few).records)
    disaggregated = summarize(run)
    # prompts' chunks share colocated steps: decode's token times stretch
    assert colocated.tpot_p90_s > 1.5 * disaggregated.tpot_p90_s


def test_bursts_arrive_inside_their_windows_at_the_same_mean_rate():
    steady = ChatWorkload(rate=10, duration_s=100).build()
    bursty = ChatWorkload(rate=10, duration_s=100, burst_every_s=10, burst_s=2).build()
    assert all(s.start_s % 10 < 2 for s in bursty)
    assert abs(len(bursty) - len(steady)) < 0.25 * len(steady)


def test_the_roofline_preset_is_memory_bound_in_decode_and_compute_bound_in_prefill():
    preset = load_preset("h200-kimi-k2")
    cost = preset.cost
    decode = StepShape(64, 64, 64 * 8000, 0, 0.0)
    prefill = StepShape(8192, 0, 0, 8192, 8192 * 4096.5)
    compute, memory = cost.bounds(decode)
    assert memory > 5 * compute and 0.01 < cost.step_s(decode) < 0.1
    compute, memory = cost.bounds(prefill)
    assert compute > 5 * memory and cost.step_s(prefill) > 2 * cost.step_s(decode)
    assert preset.worker.kv_pages > load_preset("h100-kimi-k2").worker.kv_pages > 1000
    with pytest.raises(InvalidRequestError, match="unknown cost preset"):
        load_preset("no-such-preset")


def test_fit_recovers_a_known_cost_model():
    """Probes computed as the simulator would time them (a 1-token reply's token is its last,
    the prompt beside decoding streams also waits for two half decode steps) give back the
    cost they were made with."""
    truth = LinearCost(
        "t",
        base_s=0.02,
        per_token_s=0.003,
        per_row_s=0.001,
        per_context_s=2e-6,
        per_pair_s=1e-6,
        transfer_page_s=0.0,
        rpc_s=0.01,
        decode_slowdown=1.2,
        prefill_slowdown=0.5,
        finish_s=0.03,
    )
    hops = 4 * truth.rpc_s + truth.finish_s
    prompt_step = lambda n: truth.step_s(StepShape(n, 0, 0, n, n * n / 2))  # noqa: E731
    context = lambda n, tokens: n + SUFFIX + tokens / 2  # noqa: E731
    tpot = lambda b, n, t: truth.step_s(StepShape(b, b, b * context(n, t), 0, 0))  # noqa: E731
    streams, length, tokens = CONTENDED
    contended = tpot(streams, length, tokens) * (1 + truth.decode_slowdown)
    beside = BESIDE[1]
    probes = Probes(
        [(n, hops + prompt_step(n)) for n in (32, 96, 256, 512, 1024)],
        [(b, n, tpot(b, n, DECODE_TOKENS)) for b in (1, 4, 8) for n in (64, 512)],
        contended,
        hops + contended + prompt_step(beside) * (1 + truth.prefill_slowdown),
        truth.finish_s,
    )
    got = fit(probes, "synthetic")
    for name in (
        "base_s",
        "per_token_s",
        "per_row_s",
        "per_context_s",
        "per_pair_s",
        "rpc_s",
        "decode_slowdown",
        "prefill_slowdown",
        "finish_s",
    ):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-3, abs=1e-9), name


def test_a_decode_row_is_priced_per_row_not_per_prompt_token():
    """Decode rows cost per_row_s only: a prompt token's price (per_token_s, often larger on a
    CPU) must not be charged to them."""
    shape = StepShape(
        tokens=8, decode_rows=8, decode_context=800, prefill_context=0, prefill_pairs=0.0
    )
    assert shape.prefill_tokens == 0
    assert COST.step_s(shape) == pytest.approx(COST.base_s + 8 * COST.per_row_s + 800e-6)


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 11)], 90) == 9.0


def test_kvmesh_sim_run_command(tmp_path, capsys):
    from kvmesh.cli import main

    out = tmp_path / "run.json"
    argv = [
        "sim",
        "run",
        "--preset",
        "h100-kimi-k2",
        "--prefill",
        "1",
        "--decode",
        "2",
        "--sessions",
        "6",
        "--turns",
        "2",
        "--system-tokens",
        "2000",
        "--message-tokens",
        "300",
        "--reply-tokens",
        "20",
        "--start-s",
        "1",
        "--routing",
        "cache-aware,round-robin",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "1P+2D, cache-aware" in printed and "1P+2D, round-robin" in printed
    runs = json.loads(out.read_text())["runs"]
    assert [r["requests"] for r in runs] == [12, 12] and all(r["errors"] == 0 for r in runs)
    assert main(["sim", "run", "--preset", "nope", "--sessions", "1"]) == 2  # a clear error
    assert "unknown cost preset" in capsys.readouterr().err
    assert main(["sim", "run", "--routing", "random", "--sessions", "1"]) == 2
    assert "not one of cache-aware" in capsys.readouterr().err
    assert main(["sim", "claims", "--workers", "1", "--sessions", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def _page_hashes(tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    BlockHasher.salted(PRESET.model, SPEC.page_size, PRESET.kv_dtype).extend(tokens, hashes)
    return hashes


def test_a_prompt_too_long_is_an_error_record_not_a_crash():
    short = replace(PRESET, worker=replace(SPEC, max_model_len=300))
    sessions = AgentWorkload(
        sessions=2, turns=3, system_tokens=200, message_tokens=40, reply_tokens=8
    ).build()
    run = simulate(Fleet(1, 1), short, sessions)
    assert sorted(r.turn for r in run.records if not r.error) == [1, 1, 2, 2]
    failed = [r for r in run.records if r.error]
    assert len(failed) == 2 and all("max_model_len 300" in r.error for r in failed)


def test_tune_finds_the_slowdowns_that_reproduce_a_measured_run():
    from kvmesh_apps.sim.tune import means, tune

    truth = replace(
        PRESET,
        cost=replace(COST, decode_slowdown=1.0, prefill_slowdown=0.6, decode_scale=1.5),
        shared_host=True,
    )
    workload = AgentWorkload(
        sessions=4,
        turns=4,
        system_tokens=200,
        message_tokens=40,
        reply_tokens=12,
        think_s=0.2,
        start_s=0.5,
    )
    measured = simulate(Fleet(1, 1), truth, workload.build()).records
    blind = replace(truth, cost=replace(truth.cost, prefill_slowdown=0.0, decode_scale=1.0))
    assert means(simulate(Fleet(1, 1), blind, workload.build()).records) != pytest.approx(
        means(measured), rel=0.05
    )
    tuned = tune(blind, workload, measured)
    got = means(simulate(Fleet(1, 1), tuned, workload.build()).records)
    assert got == pytest.approx(means(measured), rel=0.03)
