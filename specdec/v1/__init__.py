"""Generated gRPC stubs for the specdec.v1 protocol (`make protos`; not tracked in git)."""
