"""The unit tier (in `make test-fast` and `make test`): functions and runners in process,
each test in milliseconds to a few seconds; no gRPC server, no process."""
