"""Write the rendered parts of deploy/ (Containerfiles, the Kubernetes base, the Mooncake Store
component, the production etcd members) from kvmesh_apps/deploy: `make deploy`. A test fails when
the committed files differ from what this writes."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvmesh_apps.deploy.render import rendered  # noqa: E402


def main(out: Path = ROOT / "deploy") -> None:
    for relative, text in rendered().items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path.relative_to(out.parent) if path.is_relative_to(out.parent) else path)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "deploy")
