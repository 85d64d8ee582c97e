"""trionserve: a Triton-compatible inference server built on Trio."""

__version__ = "0.1.0"

# The Triton release whose protocol and configuration schema we follow.
TRITON_COMPATIBLE_VERSION = "2.73.0"
