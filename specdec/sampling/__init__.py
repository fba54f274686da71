"""The sampling math: logits to distributions, the residual, chain and tree acceptance,
relaxed (lossy) acceptance, a request's random streams. Pure; imports only specdec.errors."""
