"""The gRPC side: wire encodings, servers, TLS and tokens, tracing and metrics, in-process
channels, the servicer base."""
