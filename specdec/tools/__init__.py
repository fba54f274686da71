"""Developer tools outside the runtime library: the client and its CLI, the local launcher,
real-model preparation, tiny test models. No runtime layer imports these."""
