"""trionserve: a Triton-compatible inference server built on Trio."""

__version__ = "0.1.0"
