"""`kvmesh bench coldstart` reads each service's phases from its JSON log and reports the
critical path: the slowest worker per phase, None when a worker did not log a phase."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from kvmesh_apps.benchmarks.coldstart_phases import markdown, run_phases, summary

LAUNCH = 1_800_000_000.0


def _line(event: str, at: float, **fields) -> str:
    stamp = datetime.fromtimestamp(LAUNCH + at, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": event, "timestamp": stamp, "level": "info", **fields})


def _log(folder: Path, name: str, *lines: str) -> None:
    (folder / f"{name}.log").write_text("\n".join(["not json", *lines]) + "\n")


def test_phases_come_from_the_logs_and_the_slowest_worker_sets_the_path(tmp_path: Path):
    for name, slow in (("prefill-0", 0.0), ("decode-0", 2.0)):
        _log(
            tmp_path,
            name,
            _line("process.imports_done", 3.0 + slow, exec_at=LAUNCH + 1.0),
            _line("engine.weights_loaded", 3.5 + slow, cache="hit"),
            _line("tokenizer.loaded", 4.0 + slow, cache="miss"),
            _line("engine.model_built", 5.0 + slow),
            _line("engine.ready", 6.0 + slow),
            _line("worker.ready", 6.5 + slow),
            _line("worker.ready", 99.0),
        )
    _log(
        tmp_path,
        "gateway",
        _line("process.imports_done", 2.0, exec_at=LAUNCH + 0.5),
        _line("gateway.listening", 7.0),
    )

    processes = run_phases(tmp_path, LAUNCH)
    path = summary(processes, {"cli_s": 0.2, "first_token_s": 9.0})

    decode = next(p for p in processes if p.name == "decode-0")
    assert decode.marks["exec"] == 1.0 and decode.marks["ready"] == 8.5  # the first mark counts
    assert (decode.weights_cache, decode.tokenizer_cache) == ("hit", "miss")
    assert path["first_spawn_s"] == 0.5
    assert path["workers_imports_done_s"] == 5.0 and path["workers_ready_s"] == 8.5
    assert path["first_pair_ready_s"] == 8.5
    assert path["gateway_ready_s"] == 7.0 and path["first_token_s"] == 9.0
    run = {"mesh": "1+1", "variant": "cached", "loadavg_1m": 2.5, "help_s": 0.1, "summary": path}
    assert markdown([run]).splitlines()[-1].startswith("| 1+1 | cached | 2.5 | 0.10 | 0.20 |")


def test_a_phase_some_worker_did_not_log_is_unknown(tmp_path: Path) -> None:
    _log(tmp_path, "prefill-0", _line("engine.ready", 4.0), _line("worker.ready", 5.0))
    _log(tmp_path, "decode-0", _line("worker.ready", 6.0))  # an older tree: no engine line

    path = summary(run_phases(tmp_path, LAUNCH), {})

    assert path["workers_engine_ready_s"] is None
    assert path["workers_ready_s"] == 6.0
    assert path["workers_exec_s"] is None and path["first_spawn_s"] is None
