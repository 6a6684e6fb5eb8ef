"""What a fuzz run found (fuzz.py: generated requests; fuzz_edges.py: hand-made edges)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

REST_TIMEOUT_S = 60.0


@dataclass
class FuzzReport:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # HTTP status or gRPC code name
    failures: list[str] = field(default_factory=list)  # one line per violation (capped)
    seconds: float = 0.0

    def fail(self, text: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(text)
