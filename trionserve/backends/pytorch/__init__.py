"""The PyTorch backend (Triton's pytorch_backend): TorchScript and ``torch_aoti`` models."""
