"""One request's state as the scheduler and block manager see it (pure Python)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from kvmesh.engine.core.sampling_params import SamplingParams

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output), KV progress and the pages that hold it."""

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in the pool (prefix hits included)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of this seq's full pages so far
    page_tags: list[int] = field(default_factory=list)  # integrity tag expected of each page
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step only
    num_preemptions: int = 0
    integrity_recomputes: int = 0  # times its KV was recomputed after a page failed its tag
    cache_salt: str = ""
    keep_pages: bool = False  # on finish its pages stay, HELD until released (core/handover.py)
    finalizing: FinishReason | None = None  # finished; one more step computes the last token's KV
    arrival: int = field(default_factory=lambda: next(_arrival))

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
