"""The gateway's config tree: where it listens, how it routes, what a request may ask for, how
streams survive a worker's death, and what clients see of the model. `kvmesh serve gateway`
gets its flags from it; `kvmesh up` writes one for its gateway."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config.engine import DEFAULT_MODEL
from kvmesh.config.knobs import check, knob, section
from kvmesh.config.placement import Placed, Placement
from kvmesh.errors import InvalidRequestError

ROUTINGS = ("cache-aware", "prefix-aware", "least-load", "round-robin")
ROUTING_HELP = (
    "cache-aware: session affinity over prefix scores; prefix-aware: prefix scores alone; "
    "least-load: fewest tokens in flight; round-robin: each in turn (the last two are baselines)"
)
MAX_TOKENS_POLICIES = ("clamp", "refuse")


@dataclass(frozen=True)
class GatewayService(Placement):
    """Where the gateway runs (`kvmesh up` fills these in for its gateway)."""

    http_port: int = knob(8000, "REST port (OpenAI, Anthropic)", bounds=(0, 65535))
    grpc_port: int = knob(0, "gRPC Gateway port (0: a free one)", bounds=(0, 65535))

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class RoutingConfig:
    routing: str = knob("cache-aware", ROUTING_HELP, choices=ROUTINGS)
    session_ttl: int = knob(600, "x-session-affinity TTL (s)", bounds=(1, None))
    affinity_max_load_ratio: float = knob(
        2.0,
        "affinity yields when the pinned worker's load "
        "exceeds this many times the least loaded one's, plus "
        "--affinity-slack-tokens",
        bounds=(1, None),
    )
    affinity_slack_tokens: int = knob(2048, "see --affinity-max-load-ratio", bounds=(0, None))

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for: above a limit it is refused (400, or 413 for the body)
    with a message naming the limit."""

    max_body_bytes: int = knob(
        4 << 20, "larger request bodies get 413", flag="--max-request-body-bytes", bounds=(1, None)
    )
    max_prompt_tokens: int = knob(
        0, "longer prompts get 400 (0: the model's context length)", bounds=(0, None)
    )
    max_output_tokens: int = knob(
        0, "a larger max_tokens gets 400 (0: only the context length)", bounds=(0, None)
    )
    max_n: int = knob(16, "choices per request (n)", bounds=(1, None))
    # agents send 32k-64k whatever the model; llama.cpp clamps too, vLLM refuses
    max_tokens_policy: str = knob(
        "clamp",
        "a max_tokens beyond what the context leaves: clamped "
        "to it (x-kvmesh-max-tokens-clamped says so) or refused with "
        "400",
        choices=MAX_TOKENS_POLICIES,
    )

    def __post_init__(self) -> None:
        check(self)

    def check(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> None:
        if self.max_prompt_tokens and prompt_tokens > self.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {prompt_tokens} tokens, above this server's limit of "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)"
            )
        if self.max_output_tokens and max_tokens > self.max_output_tokens:
            raise InvalidRequestError(
                f"max_tokens is {max_tokens}, above this server's limit of "
                f"{self.max_output_tokens} (--max-output-tokens)"
            )
        if not 1 <= n <= self.max_n:
            raise InvalidRequestError(f"'n' must be in [1, {self.max_n}] (--max-n), got {n}")


@dataclass(frozen=True)
class StreamConfig:
    migration_limit: int = knob(
        3,
        "times a stream may move to another decode worker after its "
        "own died mid-stream (0: the client gets the error)",
        bounds=(0, None),
    )
    max_inflight_requests: int = knob(
        1024,
        "sequences the gateway streams at once; past it: 429 with Retry-After (0: no bound)",
        bounds=(0, None),
    )

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class ApiConfig:
    """What clients see: the model, its names, its tool-call format, the keys they need."""

    model: str = knob(DEFAULT_MODEL, "the mesh's model (alias, .gguf file or HF folder)")
    tool_call_parser: str = knob(
        "", "the format of the model's tool calls (default: chosen from its chat template)"
    )
    served_model_name: tuple[str, ...] = knob(
        (),
        "a model id clients may ask for; repeatable, "
        "the first is listed first (default: the model's "
        "own name)",
        style="append",
        metavar="NAME",
    )
    any_model: bool = knob(
        False,
        "answer any model id with the served model (a single-model "
        "mesh: agents that name their own models work unchanged)",
        style="switch",
    )
    api_key: tuple[str, ...] = knob(
        (),
        "a key clients must send (Authorization: Bearer KEY, or "
        "x-api-key); repeatable (default: no keys)",
        style="append",
        metavar="KEY",
    )
    api_keys_file: str = knob("", "keys, one per line (# comments)", metavar="PATH")


@dataclass(frozen=True)
class GatewayConfig(Placed):
    service: GatewayService = section(GatewayService)
    routing: RoutingConfig = section(RoutingConfig)
    limits: RequestLimits = section(RequestLimits)
    streams: StreamConfig = section(StreamConfig)
    api: ApiConfig = section(ApiConfig)
