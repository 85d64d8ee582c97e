"""One-off investigations: each answers one question about where time or memory
goes (a parser, a hop, a floor, a probe), with its write-up in this folder's
README.md. The benchmarks a user runs are one level up."""
