"""The heavy tier: `make test` runs it (three tests at a time, beside unit/ and integration/);
`make test-fast` does not. Each module here starts processes, runs a benchmark end to end, or
samples thousands of generations (over gRPC, or simulated) for a χ² test with its power check;
its docstring says which."""
