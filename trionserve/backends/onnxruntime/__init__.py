"""The ONNX Runtime backend (Triton's onnxruntime_backend)."""
