"""Generate the gRPC stubs of protos/kvmesh/v1 into kvmesh/proto/v1 (imports rewritten).

`python scripts/gen_protos.py [OUT_DIR]`; `make protos` runs it; a test regenerates into a temp
dir and fails when the committed stubs differ.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "kvmesh" / "proto" / "v1"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(
        str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "kvmesh" / "v1").glob("*.proto")
    )
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(PROTO_ROOT),
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / "kvmesh" / "v1").iterdir()):
            text = re.sub(
                r"\bfrom kvmesh\.v1 import\b", "from kvmesh.proto.v1 import", src.read_text()
            )
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
        (out_dir / "__init__.py").write_text(
            '"""Generated gRPC stubs (make protos). Do not edit."""\n'
        )
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    if target == DEFAULT_OUT and target.exists():
        shutil.rmtree(target)
    for path in generate(target):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
