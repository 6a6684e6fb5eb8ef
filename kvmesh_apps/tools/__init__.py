"""Developer tools behind `kvmesh` sub-commands that serve no request (e.g. `make-tiny-model`).

Importing this package imports no torch: each tool imports what it runs."""
