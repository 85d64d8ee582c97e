"""Metrics, statistics, logging and tracing."""
