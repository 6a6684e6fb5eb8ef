"""The gateway's routing policies by name (`--routing`), importable without grpc: the CLI's
parser offers them, services/gateway/router.py builds them, `kvmesh sim` compares them."""

ROUTINGS = ("cache-aware", "prefix-aware", "least-load", "round-robin")
ROUTING_HELP = (
    "cache-aware: session affinity over prefix scores; prefix-aware: prefix scores alone; "
    "least-load: fewest tokens in flight; round-robin: each in turn (the last two are baselines)"
)
