"""Peer servers for side-by-side runs: Triton, KServe and MLServer.

Each peer installs into its own virtual environment (outside the repository),
is started on loopback ports with the same two models as trionserve (`simple`
and `identity_fp32`), and is skipped with the reason when it cannot be
installed or started. Run with ``python -m benchmarks.peers``.
"""
