"""kvmesh's applications, beside the library: the benchmarks (`kvmesh bench`), the fleet
simulator (`kvmesh sim`), deployment (images, Kubernetes), the tiny-model tools
(`kvmesh make-tiny-model`) and the offline demo (`kvmesh up --demo`). The `kvmesh` CLI dispatches
to them; nothing in the `kvmesh` library imports them."""
