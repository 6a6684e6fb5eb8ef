"""The streaming loader: LazyWeights reads one tensor per access and keeps none; the
safetensors reader/writer round-trips (and stays readable by the safetensors library); reads
converted to a dtype equal `.to(dtype)` bit for bit; GGUF tensors read lazily equal the whole-file
conversion the loader used to do, for tiny files and (slow) the default model."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.engine.config import ModelConfig
from kvmesh.engine.loader import (
    LazyWeights,
    gguf_loader,
    load_weights,
    model_cache,
    resolve_model,
    safetensors_io,
)
from kvmesh.engine.loader.gguf_header import read_header
from kvmesh.engine.loader.gguf_loader import (
    gguf_metadata,
    hf_name,
    load_gguf,
    open_gguf,
    unpermute,
)
from kvmesh.engine.loader.memory import current_rss_bytes, peak_rss_bytes, release_freed_memory
from kvmesh.engine.loader.safetensors_io import SafetensorsFile, SafetensorsWriter
from kvmesh.engine.quant.int4 import Int4Weight
from kvmesh.errors import ModelFormatError
from tests.unit.tiny_checkpoints import write_sharded_folder, write_tiny_gguf

TENSORS = {
    "f32": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)),
    "bf16": torch.randn(3, 4).to(torch.bfloat16),
    "f16": torch.randn(6).half(),
    "u8": torch.arange(11, dtype=torch.uint8),
    "i64": torch.tensor([-(2**40), 3]),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
}


def counting(values: dict[str, torch.Tensor]) -> tuple[LazyWeights, list[str]]:
    reads: list[str] = []

    def reader(name: str):
        def read(dtype):
            reads.append(name)
            return values[name].clone().to(dtype or values[name].dtype)

        return read

    return LazyWeights({n: reader(n) for n in values}), reads


def test_membership_length_and_names_read_nothing() -> None:
    weights, reads = counting({"a": torch.ones(2), "b": torch.zeros(3)})
    assert "a" in weights and "c" not in weights and len(weights) == 2
    assert list(weights) == ["a", "b"] and weights.keys() == {"a", "b"}
    assert weights.get("c") is None
    assert reads == []


def test_each_access_reads_anew_and_the_mapping_keeps_nothing() -> None:
    weights, reads = counting({"a": torch.arange(4.0)})
    first = weights["a"]
    second = weights.get("a")
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    dropped = weakref.ref(first)
    del first
    gc.collect()
    assert dropped() is None  # no reference held by the mapping
    assert reads == ["a", "a"]


def test_pop_reads_and_forgets() -> None:
    weights, reads = counting({"a": torch.ones(1), "b": torch.ones(2)})
    assert torch.equal(weights.pop("a"), torch.ones(1))
    assert "a" not in weights and len(weights) == 1
    assert weights.pop("b", dtype=torch.bfloat16).dtype == torch.bfloat16 and not weights
    assert weights.pop("a", None) is None
    with pytest.raises(KeyError):
        weights.pop("a")
    with pytest.raises(KeyError):
        weights["missing"]
    assert reads == ["a", "b"]


def test_closing_closes_the_files_and_refuses_reads(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    _write(path, TENSORS)
    file = SafetensorsFile(path)
    weights = LazyWeights({"f32": file.read}, [file]).derive({"x": lambda d: 1})
    weights.close()
    assert weights.closed
    with pytest.raises(ValueError, match="closed"):
        weights["x"]


def test_a_dict_wraps_as_it_is() -> None:
    values = {"a": torch.ones(3)}
    lazy = LazyWeights.of(values)
    assert lazy["a"] is values["a"] and LazyWeights.of(lazy) is lazy
    assert lazy.read("a", torch.bfloat16).dtype == torch.bfloat16


# --- the safetensors format -----------------------------------------------------------------


def _write(path: Path, tensors: dict[str, torch.Tensor], room: int = 4096) -> None:
    with SafetensorsWriter(path, room) as out:
        for name, tensor in tensors.items():
            out.add(name, tensor)
        out.finish({"k": "v"})


@pytest.mark.parametrize("room", [4096, 0])  # 0: the header outgrows its room, data moves
def test_written_files_read_back_here_and_in_the_safetensors_library(tmp_path, room) -> None:
    from safetensors import safe_open

    path = tmp_path / "t.safetensors"
    _write(path, TENSORS, room)
    file = SafetensorsFile(path)
    assert file.metadata == {"k": "v"} and file.names == list(TENSORS)
    with safe_open(str(path), framework="pt") as theirs:
        assert theirs.metadata() == {"k": "v"}
        for name, tensor in TENSORS.items():
            for got in (file.read(name), theirs.get_tensor(name)):
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_the_library_files_read_here(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(TENSORS, str(tmp_path / "t.safetensors"), metadata={"a": "b"})
    file = SafetensorsFile(tmp_path / "t.safetensors")
    assert file.metadata == {"a": "b"}
    assert all(torch.equal(file.read(n), t) for n, t in TENSORS.items())


@pytest.mark.parametrize("cut", [4, 20, -1])
def test_torn_or_foreign_files_are_model_format_errors(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "t.safetensors"
    _write(path, TENSORS)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ModelFormatError, match="t.safetensors"):
        SafetensorsFile(path)
    (tmp_path / "x.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{not json} " * 2)
    with pytest.raises(ModelFormatError, match="x.safetensors"):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_reads_converted_to_a_dtype_are_bit_identical(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 64)  # 5 x 7 floats: chunks of 2 rows
    big = {"w": torch.randn(5, 7) * 1e3, "h": torch.randn(9, 3).to(torch.bfloat16)}
    _write(tmp_path / "t.safetensors", big)
    file = SafetensorsFile(tmp_path / "t.safetensors")
    for name, tensor in big.items():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            got = file.read(name, dtype)
            assert got.dtype == dtype and torch.equal(got, tensor.to(dtype)), (name, dtype)


def test_a_sharded_folder_is_lazy_over_every_shard(tmp_path: Path) -> None:
    expected = write_sharded_folder(tmp_path / "tiny-llama")
    _, weights = load_weights(resolve_model(str(tmp_path / "tiny-llama")))
    assert isinstance(weights, LazyWeights) and weights.keys() == expected.keys()
    assert all(torch.equal(weights.pop(n), t) for n, t in expected.items())
    assert len(weights) == 0


# --- GGUF --------------------------------------------------------------------------------------


def reference_load_gguf(reader, config: ModelConfig, int4: bool) -> dict[str, object]:
    """The whole-file conversion load_gguf did before it streamed (kept as the reference)."""
    import gguf

    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    out: dict[str, object] = {}
    for tensor in reader.tensors:
        name, part = hf_name(tensor.name), hf_name(tensor.name).split(".")[-2]
        rows, cols = (int(d) for d in reversed(tensor.shape)) if len(tensor.shape) == 2 else (0, 0)
        if int4 and tensor.tensor_type.name in ("Q4_0", "Q4_1") and rows:
            weight = Int4Weight.from_gguf_blocks(tensor.data, tensor.tensor_type.name, rows, cols)
            if part in heads and config.architecture == "llama":
                order = unpermute(np.arange(rows)[:, None], heads[part])[:, 0]
                weight = weight.rows(torch.from_numpy(np.ascontiguousarray(order)))
            out[name] = weight
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        array = array.reshape(shape)
        if part in heads and config.architecture == "llama":
            array = unpermute(array, heads[part])
        out[name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).copy())
    return out


def assert_identical(lazy: LazyWeights, reference: dict[str, object]) -> None:
    assert lazy.keys() == reference.keys()
    for name, want in reference.items():
        got = lazy[name]
        if isinstance(want, Int4Weight):
            assert isinstance(got, Int4Weight) and got.group == want.group, name
            for part in ("q", "scale", "zero"):
                a, b = getattr(got, part), getattr(want, part)
                assert a.dtype == b.dtype and torch.equal(a, b), (name, part)
            continue
        assert got.dtype == want.dtype and torch.equal(got, want), name
        bf16 = lazy.read(name, torch.bfloat16)
        assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, want.to(torch.bfloat16)), name


def quantized_gguf(path: Path) -> Path:
    import gguf

    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (
        ("block_count", 1),
        ("vocab_size", 300),
        ("context_length", 64),
        ("embedding_length", 64),
        ("feed_forward_length", 64),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 1),
    ):
        writer.add_uint32(f"llama.{key}", value)
    shapes = {
        "token_embd.weight": ("Q8_0", (300, 64)),
        "blk.0.attn_q.weight": ("Q4_1", (64, 64)),
        "blk.0.attn_k.weight": ("Q4_0", (32, 64)),
        "blk.0.attn_v.weight": ("F16", (32, 64)),
        "blk.0.attn_norm.weight": ("F32", (64,)),
        "output.weight": ("BF16", (300, 64)),
    }
    for name, (qtype, shape) in shapes.items():
        kind = gguf.GGMLQuantizationType[qtype]
        packed = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), kind)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("int4", [False, True])
def test_gguf_tensors_read_lazily_equal_the_whole_file_conversion(tmp_path, monkeypatch, int4):
    monkeypatch.setattr(gguf_loader, "_row_chunks", lambda shape: _slices(shape[0], 7))
    path = quantized_gguf(tmp_path / "q.gguf")
    config, weights = load_gguf(path, int4)
    assert not config.tie_word_embeddings  # the file has output.weight
    assert_identical(weights, reference_load_gguf(open_gguf(path), config, int4))


def _slices(rows: int, step: int) -> list[slice]:
    return [slice(i, i + step) for i in range(0, rows, step)]


def test_a_gguf_cut_before_or_after_opening_is_a_model_format_error(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, {"token_embd.weight": np.ones((16, 8), np.float32)})
    whole = path.read_bytes()
    _, weights = load_gguf(path)
    path.write_bytes(whole[:-100])
    with pytest.raises(ModelFormatError, match="truncated"):
        weights["model.embed_tokens.weight"]
    with pytest.raises(ModelFormatError):
        load_gguf(path)


@pytest.fixture(scope="module")
def default_reader(default_model_source):
    return open_gguf(default_model_source.gguf_file)


@pytest.mark.slow
@pytest.mark.parametrize("int4", [False, True])
def test_the_default_model_streams_bit_identical_tensors(
    default_model_source, default_reader, int4
) -> None:
    config, weights = load_gguf(default_model_source.gguf_file, int4)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert_identical(weights, reference_load_gguf(default_reader, config, int4))


# --- the converted-model cache -----------------------------------------------------------------


def test_a_cache_hit_is_lazy_and_a_failed_write_still_serves(tmp_path, monkeypatch) -> None:
    from tests.unit.test_model_cache import tiny_gguf

    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "home"))
    source = resolve_model(str(tiny_gguf(tmp_path / "tiny.gguf")))
    reference = {n: w.to(torch.bfloat16) for n, w in load_weights(source)[1].items()}
    with monkeypatch.context() as patched:
        patched.setattr(model_cache, "write_tensors", _full_disk)
        unwritten = model_cache.load_cached(source.gguf_file, "bf16", lambda: load_weights(source))
    assert not list((tmp_path / "home").glob("cache/models/*/*.safetensors"))
    model_cache.load_cached(source.gguf_file, "bf16", lambda: load_weights(source))
    hit = model_cache.load_cached(source.gguf_file, "bf16", lambda: pytest.fail("converted"))
    assert (unwritten.cache, hit.cache) == ("miss", "hit")
    for loaded in (unwritten, hit):
        assert isinstance(loaded.weights, LazyWeights)
        assert all(torch.equal(loaded.weights[n], t) for n, t in reference.items())
        assert loaded.weights["model.norm.weight"].dtype == torch.bfloat16


def _full_disk(*_: object) -> None:
    raise OSError(28, "No space left on device")


def test_an_entry_with_a_broken_int4_triplet_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    with SafetensorsWriter(path, 1024) as out:
        out.add("w#q", torch.zeros(2, 32, dtype=torch.uint8))
        out.finish({"config": "{}", "int4": json.dumps({"w": 32})})
    assert model_cache.open_entry(path) is None


def test_memory_readings() -> None:
    release_freed_memory()
    now = current_rss_bytes()
    assert now is not None and 0 < now <= peak_rss_bytes()


# --- the GGUF header -----------------------------------------------------------------------------


def assert_header_is_the_readers(path: Path) -> None:
    reader = open_gguf(path)
    header = read_header(path)
    assert header.metadata == gguf_metadata(reader)
    assert list(header.metadata) == list(gguf_metadata(reader))
    skipped = {k: len(f.data) for k, f in reader.fields.items() if k not in header.metadata}
    assert header.lengths == {k: n for k, n in skipped.items() if k.startswith("tokenizer.")}
    rows = [
        (
            t.name,
            t.tensor_type.name,
            tuple(int(d) for d in reversed(t.shape)),
            t.data_offset,
            tuple(t.data.shape),
            t.data.dtype,
        )
        for t in reader.tensors
    ]
    assert [
        (t.name, t.qtype, t.shape, t.offset, t.items, t.item_dtype) for t in header.tensors
    ] == rows


@pytest.mark.parametrize("order", ["LITTLE", "BIG"])
def test_the_gguf_header_reads_as_the_gguf_reader_does(tmp_path: Path, order: str) -> None:
    import gguf

    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian[order])
    writer.add_uint32("llama.block_count", 1)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_float32("llama.rope.freq_base", 1e-5)
    writer.add_float64("x.f64", 0.1)
    writer.add_int64("x.i64", -(2**40))
    writer.add_string("general.name", "naïve 東京")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "東"])
    writer.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5])
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3])
    writer.add_array("x.strings", ["p", "q"])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_array("x.empty", [])
    writer.add_custom_alignment(64)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float16))
    packed = gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor(
        "output.weight", packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_header_is_the_readers(path)
    assert read_header(path).lengths["tokenizer.ggml.tokens"] == 3


@pytest.mark.slow
def test_the_default_models_header_reads_as_the_gguf_reader_does(default_model_source) -> None:
    assert_header_is_the_readers(default_model_source.gguf_file)
