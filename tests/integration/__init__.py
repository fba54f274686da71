"""The integration tier (in `make test-fast` and `make test`): the three services in this
process over real gRPC with tiny real models; greedy identity in every mode and drafter,
errors, batching. No process is started here (tests/heavy and tests/serial start them)."""
