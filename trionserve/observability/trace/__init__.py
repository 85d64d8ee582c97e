"""Request tracing (Triton's trace extension): settings, the manager, trace files, OpenTelemetry."""
