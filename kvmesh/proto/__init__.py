"""Generated protobuf / gRPC stubs of protos/kvmesh/v1."""
