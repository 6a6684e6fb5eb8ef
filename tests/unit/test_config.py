"""The config tree: every engine knob has its flag on every command that runs an engine, the
flag reaches the knob, a worker's config survives the file `kvmesh up` hands it, and
`kvmesh config show` prints what each child of `up` would run with."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from kvmesh.cli_args import build_parser
from kvmesh.config import EngineConfig, WorkerConfig
from kvmesh.config.flags import from_namespace
from kvmesh.config.gateway import GatewayConfig
from kvmesh.config.knobs import Knob, flat, iter_knobs, knob_names, to_dict
from kvmesh.errors import InvalidRequestError

ENGINE_COMMANDS = (
    ("generate", "--prompt", "x"),
    ("serve", "prefill", "--etcd", "127.0.0.1:1"),
    ("serve", "decode", "--etcd", "127.0.0.1:1"),
    ("up",),
)


def _sample(name: str, default, spec: Knob) -> tuple[list[str], object]:
    """A flag's command-line words for a value other than the default, and that value."""
    flag = spec.flag_of(name)
    if spec.style == "switch":
        return [flag], True
    if spec.style == "append":
        return [flag, "y", flag, "z"], ("y", "z")
    if spec.style == "on_off":
        return [flag, "off" if default else "on"], not default
    if spec.choices is not None:
        value = next((c for c in spec.choices if c != default), default)  # device: cpu only
        return [flag, str(value)], value
    if name == "kv_cache_bytes":
        return [flag, "2MiB"], 2 << 20
    if isinstance(default, float):
        return [flag, "2.5"], 2.5
    if isinstance(default, str):
        return [flag, "x"], "x"
    return [flag, "2"], 2


ENGINE_KNOBS = [(f.name, f.default, spec) for _, f, spec in iter_knobs(EngineConfig)]


def test_knob_names_are_unique_in_a_worker_tree():
    names = knob_names(WorkerConfig)
    assert len(names) == len(set(names)) > 40


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize(
    ("name", "default", "spec"), ENGINE_KNOBS, ids=[k[0] for k in ENGINE_KNOBS]
)
def test_every_engine_knob_is_a_flag_of_every_command_that_runs_an_engine(
    command, name, default, spec
):
    words, value = _sample(name, default, spec)
    if name == "enable_expert_parallel":
        words += ["--tensor-parallel-size", "2"]
    argv = [*command, *words]
    args = build_parser(argv).parse_args(argv)
    if command[0] == "up":
        from kvmesh.mesh.up_config import up_workers

        for worker in up_workers(args).values():
            assert flat(worker.engine)[name] == value
    else:
        assert flat(from_namespace(EngineConfig, args))[name] == value


def test_help_shows_the_knobs_declared_help_and_default(capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve", "decode"]).parse_args(["serve", "decode", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS tokens in a step at most" in text
    assert "(default: 1024)" in text and "--kv-integrity on|off" in text


def test_a_bad_value_is_refused_by_the_flag_and_by_the_config():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--kv-dtype", "int3"])
    with pytest.raises(InvalidRequestError, match="page_size must be a power of two"):
        EngineConfig.of(page_size=24)
    with pytest.raises(InvalidRequestError, match="max_num_seqs must be in >= 1"):
        EngineConfig.of(max_num_seqs=0)
    with pytest.raises(TypeError, match="no knob max_seqs"):
        EngineConfig.of(max_seqs=4)


def test_a_workers_config_file_is_the_config_and_later_flags_win(tmp_path):
    config = WorkerConfig(
        "decode", EngineConfig.of(model="m", kv_dtype="fp8_e4m3", max_num_batched_tokens=96)
    ).placed(etcd="127.0.0.1:9", worker_id="decode-3")
    path = tmp_path / "decode-3.json"
    path.write_text(json.dumps(to_dict(config)))
    argv = ["serve", "decode", "--config", str(path)]
    parsed = from_namespace(WorkerConfig, build_parser(argv).parse_args(argv), role="decode")
    assert parsed == config
    argv += ["--max-num-seqs", "3"]
    parsed = from_namespace(WorkerConfig, build_parser(argv).parse_args(argv), role="decode")
    assert parsed.engine.scheduler.max_num_seqs == 3 and parsed.engine.cache.kv_dtype == "fp8_e4m3"
    path.write_text(json.dumps({"engine": {"cache": {"pages": 3}}}))
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)


def test_kvmesh_up_hands_each_worker_its_config_as_a_file(tmp_path, monkeypatch):
    from kvmesh.mesh import children
    from kvmesh.mesh.launcher import Mesh
    from kvmesh.mesh.up_config import worker_configs

    workers = worker_configs("--kv-dtype", "bf16", decode=("--tensor-parallel-size", "2"))
    from kvmesh.mesh.launcher import UpOptions

    mesh = Mesh(UpOptions(workers=workers, decode=2), run_dir=tmp_path)
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(mesh, "_spawn", lambda name, args, *_: spawned.setdefault(name, args))
    mesh._spawn_workers()
    assert sorted(spawned) == ["decode-0", "decode-1", "prefill-0"]
    for name, args in spawned.items():
        role = name.split("-")[0]
        assert args == ["serve", role, "--config", str(tmp_path / f"{name}.json")]
        argv = [*args, "--etcd", "127.0.0.1:1"]  # what _spawn adds
        parsed = from_namespace(WorkerConfig, build_parser(argv).parse_args(argv), role=role)
        assert parsed == children.worker(mesh.options, mesh.placement, role, name).placed(
            etcd="127.0.0.1:1"
        )
        assert parsed.service.worker_id == name
        assert parsed.engine.parallel.tensor_parallel_size == (2 if role == "decode" else 1)


def test_config_show_prints_every_child_of_up():
    from kvmesh.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        code = main(
            ["config", "show", "up", "--decode-tp", "2", "--kv-dtype", "fp8_e4m3", "--decode", "2"]
        )
    assert code == 0
    shown = json.loads(out.getvalue())
    assert {"prefill-0", "decode-0", "decode-1", "gateway", "kvstore"} <= set(shown)
    for name in ("prefill-0", "decode-0", "decode-1"):
        engine = shown[name]["engine"]
        assert engine["cache"]["kv_dtype"] == "fp8_e4m3"
        want = 2 if name.startswith("decode") else 1
        assert engine["parallel"]["tensor_parallel_size"] == want
        assert shown[name]["service"]["worker_id"] == name


def test_config_show_of_a_worker_and_of_generate():
    from kvmesh.config_show import effective_config

    decode = effective_config(["serve", "decode", "--etcd", "e:1", "--page-size", "32"])["decode"]
    assert decode["engine"]["cache"]["page_size"] == 32 and decode["service"]["etcd"] == "e:1"
    engine = effective_config(["generate", "--prompt", "x", "--decode-step", "eager"])["engine"]
    assert engine["device"]["decode_step"] == "eager"


def test_every_knob_default_is_valid_and_the_tree_round_trips():
    from kvmesh.config.knobs import from_dict

    config = WorkerConfig()
    assert from_dict(WorkerConfig, json.loads(json.dumps(to_dict(config)))) == config


GATEWAY_KNOBS = [(f.name, f.default, spec) for _, f, spec in iter_knobs(GatewayConfig)]
UP_PLACES = ("etcd", "cluster", "host", "http_port", "grpc_port", "model")  # up's own, or set


@pytest.mark.parametrize("command", [("serve", "gateway", "--etcd", "e:1"), ("up",)], ids=str)
@pytest.mark.parametrize(
    ("name", "default", "spec"), GATEWAY_KNOBS, ids=[k[0] for k in GATEWAY_KNOBS]
)
def test_every_gateway_knob_is_a_flag_of_serve_gateway_and_up(command, name, default, spec):
    if command[0] == "up" and name in UP_PLACES:
        pytest.skip("kvmesh up places its gateway itself")
    words, value = _sample(name, default, spec)
    argv = [*command, *words]
    args = build_parser(argv).parse_args(argv)
    if command[0] == "up":
        from kvmesh.mesh.up_config import up_gateway

        config = up_gateway(args)
    else:
        config = from_namespace(GatewayConfig, args)
    assert flat(config)[name] == value


def test_kvmesh_up_hands_its_gateway_a_config_file_and_its_keys_in_the_environment(
    tmp_path, monkeypatch
):
    from kvmesh.env import API_KEYS_ENV
    from kvmesh.mesh.launcher import Mesh, UpOptions
    from kvmesh.mesh.up_config import gateway_config, worker_configs

    gateway = gateway_config("--api-key", "k1", "--routing", "least-load", "--max-n", "2")
    options = UpOptions(workers=worker_configs("--model", "m"), gateway=gateway)
    mesh = Mesh(options, run_dir=tmp_path)
    spawned = {}
    monkeypatch.setattr(
        mesh, "_spawn", lambda name, args, env, cpus: spawned.update(args=args, env=env)
    )
    mesh._spawn_gateway()
    assert spawned["args"] == ["serve", "gateway", "--config", str(tmp_path / "gateway.json")]
    assert spawned["env"] == {API_KEYS_ENV: "k1"}
    assert "k1" not in (tmp_path / "gateway.json").read_text()
    argv = [*spawned["args"], "--etcd", "e:1"]
    config = from_namespace(GatewayConfig, build_parser(argv).parse_args(argv))
    assert (config.api.model, config.routing.routing, config.limits.max_n) == ("m", "least-load", 2)
    assert config.api.api_key == ()


def test_config_show_of_up_has_the_kv_store_and_the_draft_service():
    from kvmesh.config_show import effective_config

    shown = effective_config(
        [
            "up",
            "--kvstore",
            "mooncake",
            "--kvstore-ram-mib",
            "64",
            "--speculative",
            "eagle",
            "--draft",
            "remote",
            "--protocol",
            "rdma",
        ]
    )
    store = shown["kvstore"]
    assert store["tiers"]["ram_mib"] == 64 and store["tiers"]["backend"] == "mooncake"
    assert store["transfer"]["protocol"] == "rdma" and store["layout"]["page_bytes"] is None
    assert shown["draft"]["head"]["model"] == shown["decode-0"]["engine"]["load"]["model"]


@pytest.mark.parametrize(
    ("service", "root"),
    [("kvstore", "KVStoreConfig"), ("draft", "DraftConfig"), ("gateway", "GatewayConfig")],
)
def test_every_service_knob_is_a_flag_of_its_serve_command(service, root):
    import kvmesh.config.draft
    import kvmesh.config.gateway
    import kvmesh.config.kvstore

    cls = next(
        getattr(m, root)
        for m in (kvmesh.config.draft, kvmesh.config.gateway, kvmesh.config.kvstore)
        if hasattr(m, root)
    )
    for _, f, spec in iter_knobs(cls):
        words, value = _sample(f.name, f.default, spec)
        if f.name == "rdma_devices":
            words += ["--protocol", "rdma"]
        argv = ["serve", service, *words]
        assert flat(from_namespace(cls, build_parser(argv).parse_args(argv)))[f.name] == value


def test_with_knobs_changes_knobs_across_sections_and_keeps_the_rest():
    from kvmesh.config.knobs import with_knobs

    worker = WorkerConfig("prefill", EngineConfig.of(kv_dtype="bf16"))
    changed = with_knobs(worker, max_num_seqs=3, protocol="rdma")
    assert changed.role == "prefill" and changed.engine.cache.kv_dtype == "bf16"
    assert changed.engine.scheduler.max_num_seqs == 3 and changed.transfer.protocol == "rdma"
    with pytest.raises(TypeError, match="no knob"):
        with_knobs(worker, max_seqs=3)


def _up_knobs():
    from kvmesh.config.kvstore import Tiers
    from kvmesh.config.up import MeshConfig, RoleOverrides

    skip = {"backend", "mooncake_master", "demo"}  # up places the first two; demo: no mesh
    for prefix, cls in (("", MeshConfig), ("kvstore", Tiers), ("prefill", RoleOverrides)):
        for _, f, spec in iter_knobs(cls):
            if f.name not in skip:
                yield prefix, f.name, f.default, spec


@pytest.mark.parametrize(
    ("prefix", "name", "default", "spec"), list(_up_knobs()), ids=lambda v: str(v)[:20]
)
def test_every_knob_of_up_itself_reaches_its_options(prefix, name, default, spec):
    """`up`'s own knobs (config/up.py), the KV store's tiers as --kvstore-*, a role's as
    --prefill-*: each flag, given a value other than its default, reaches UpOptions."""
    from kvmesh.mesh.up_config import up_options

    words, value = _sample(name, default, spec)
    if prefix:
        words[0] = f"--{prefix}-{words[0][2:]}"
    if name == "weights":  # a role's precision: a real one (auto is the engine's choice)
        words, value = [words[0], "fp32"], "fp32"
    options = up_options(build_parser().parse_args(["up", "--dtype", "fp32", *words]))
    if prefix == "kvstore":
        assert getattr(options.store.tiers, name) == value
    elif prefix == "prefill":  # the prefill workers' knob, not the decode workers'
        role = {}
        for worker, engine in ((w, options.workers[w].engine) for w in ("prefill", "decode")):
            role[worker] = {
                "weights": engine.load.weights,
                "tp": engine.parallel.tensor_parallel_size,
                "pp": engine.parallel.pipeline_parallel_size,
            }[name]
        assert role["prefill"] == value != role["decode"]
    else:
        assert getattr(options, name) == value
