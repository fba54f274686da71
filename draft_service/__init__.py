"""Draft service: a small causal LM that proposes K tokens with their exact distributions."""
