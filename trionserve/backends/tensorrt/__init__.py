"""The TensorRT backend (Triton's tensorrt_backend)."""
