"""Target service: the large model; verifies draft tokens in one forward pass per round."""
