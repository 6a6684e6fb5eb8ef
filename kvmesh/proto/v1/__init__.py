"""Generated gRPC stubs (make protos). Do not edit."""
