"""Coordinator: the public Generate API; runs lossless rejection sampling between draft and target."""
