"""Token-level workloads, the same for the simulator and a live mesh (mesh_run.py).

Every workload is a set of sessions, each a closed loop of turns: a turn's prompt is the
session's history (shared system prompt, then its messages and the replies so far) plus a new
message; the next turn is sent a pause (`think_s` on average) after the reply ended. Chat is sessions of one turn;
bursts are chat whose arrivals come in waves. Replies in the simulator are the tokens drawn here;
on a live mesh they are what the model generated (greedy, EOS ignored), so the next prompt holds
the model's own output as an agent's history does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Session:
    session_id: str
    start_s: float
    system: list[int]
    messages: list[list[int]]  # one per turn
    replies: list[list[int]]  # the simulator's reply per turn (max_tokens long)
    thinks: list[float]  # the pause after each turn's reply (an agent's tool time)
    affinity: bool
    history: list[int] = field(default_factory=list)
    turn: int = 0

    def prompt(self) -> list[int]:
        """The next turn's prompt: the history so far and this turn's message."""
        if not self.history:
            self.history = list(self.system)
        return [*self.history, *self.messages[self.turn]]

    def replied(self, reply: list[int]) -> bool:
        """Record the reply to the current turn; False when the session is over."""
        self.history = [*self.history, *self.messages[self.turn], *reply]
        self.turn += 1
        return self.turn < len(self.messages)

    @property
    def think_s(self) -> float:
        """The pause before the next turn (after `replied`)."""
        return self.thinks[self.turn - 1]

    @property
    def affinity_id(self) -> str | None:
        return self.session_id if self.affinity else None


@dataclass(frozen=True)
class AgentWorkload:
    """Agent sessions: `systems` shared system prompts (apps), growing histories."""

    sessions: int = 64
    turns: int = 8
    system_tokens: int = 1000
    systems: int = 1
    message_tokens: int = 200  # a tool result or user message: uniform in [0.5x, 1.5x]
    reply_tokens: int = 32
    think_s: float = 1.0  # mean pause between turns: uniform in [0.5x, 1.5x]
    start_s: float = 10.0  # sessions start uniformly over this window
    affinity: bool = True  # send x-session-affinity
    vocab: int = 32000
    seed: int = 0

    def build(self) -> list[Session]:
        rng = random.Random(self.seed)
        timing = random.Random(self.seed + 1_000_003)  # times do not depend on the vocabulary
        tokens = lambda n: [rng.randrange(16, self.vocab) for _ in range(n)]  # noqa: E731
        systems = [tokens(self.system_tokens) for _ in range(self.systems)]
        out = []
        for i in range(self.sessions):
            lengths = [
                rng.randint(self.message_tokens // 2, self.message_tokens * 3 // 2)
                for _ in range(self.turns)
            ]
            thinks = [timing.uniform(0.5, 1.5) * self.think_s for _ in lengths]
            out.append(
                Session(
                    f"s{self.seed}-{i}",
                    timing.uniform(0, self.start_s),
                    systems[i % self.systems],
                    [tokens(n) for n in lengths],
                    [tokens(self.reply_tokens) for _ in lengths],
                    thinks,
                    self.affinity,
                )
            )
        return sorted(out, key=lambda s: s.start_s)


@dataclass(frozen=True)
class ChatWorkload:
    """One-turn requests at `rate` per second (Poisson), over `templates` shared prefixes;
    `burst_every_s` > 0 sends them in waves: the whole rate in the first `burst_s` of each."""

    rate: float = 10.0
    duration_s: float = 30.0
    prefix_tokens: int = 500
    templates: int = 8
    prompt_tokens: int = 300  # after the prefix: uniform in [0.5x, 1.5x]
    reply_tokens: int = 64
    burst_every_s: float = 0.0
    burst_s: float = 2.0
    vocab: int = 32000
    seed: int = 0

    def build(self) -> list[Session]:
        rng = random.Random(self.seed)
        tokens = lambda n: [rng.randrange(16, self.vocab) for _ in range(n)]  # noqa: E731
        prefixes = [tokens(self.prefix_tokens) for _ in range(self.templates)]
        bursty = self.burst_every_s > 0
        rate = self.rate * self.burst_every_s / self.burst_s if bursty else self.rate
        out, u = [], 0.0  # u: time inside bursts only (all of it without bursts)
        while True:
            u += rng.expovariate(rate)
            start = (u // self.burst_s) * self.burst_every_s + u % self.burst_s if bursty else u
            if start >= self.duration_s:
                return out
            n = rng.randint(self.prompt_tokens // 2, self.prompt_tokens * 3 // 2)
            out.append(
                Session(
                    f"c{self.seed}-{len(out)}",
                    start,
                    rng.choice(prefixes),
                    [tokens(n)],
                    [tokens(self.reply_tokens)],
                    [0.0],
                    False,
                )
            )
