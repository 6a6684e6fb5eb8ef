"""Routing: which worker a request goes to. The core (router.py: policies and pins; prefix.py:
which worker holds a prompt's pages; sessions.py: session pins) is shared by the gateway and
`kvmesh sim`. This module, importable without grpc, names the policies (`--routing`, offered by
the CLI's parser) and says which prompts `kvmesh up` leaves to the decode worker's own prefill."""

from kvmesh.config.gateway import ROUTING_HELP, ROUTINGS  # noqa: F401 (the routing names)

# `kvmesh up`: prompts up to this many tokens are prefilled by the decode worker itself (Dynamo's
# conditional disaggregation): such a prompt costs about what a few decode steps cost, less than
# handing it to a prefill worker and its pages back (docs/benchmarks.md, "P/D: colocated vs
# disaggregated"; docs/benchmarks-history.md, "INT4 by bf16 dot products, uvloop, and short
# prompts prefilled on decode"). Longer prompts go to a prefill worker.
UP_LOCAL_PREFILL_TOKENS = 128
