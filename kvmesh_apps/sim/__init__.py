"""`kvmesh sim`: the fleet on a simulated clock, on the gateway's real router.

The gateway's own `Router` (policies, load estimates, session pins) and `PrefixIndex` route
simulated requests to simulated prefill and decode workers; each worker runs the engine's own
`Scheduler` and `BlockManager` (continuous batching, chunked prefill, preemption, prefix cache
with real eviction and KV events), and only the time a step takes comes from a cost model
(cost.py: fitted to a mesh on this machine, or a roofline of an H100/H200 serving a
Kimi-K2-class model). Pure Python: no torch.
"""
