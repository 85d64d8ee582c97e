"""The runtime: a tree of Trio actors that load models and execute requests."""
