"""torch, imported when a PyTorch model loads (torch is an optional extra), and the
device an instance runs on; shared by TorchScript (:mod:`.backend`) and
``torch_aoti`` (:mod:`.torch_aoti`) models."""

from __future__ import annotations

from typing import Any

from trionserve.backends.base import InstanceSpec
from trionserve.core.errors import Unavailable


def _import_torch() -> Any:
    import torch

    return torch


def require_torch() -> Any:
    """torch, or Unavailable naming the missing package (torch is an optional extra)."""
    try:
        return _import_torch()
    except ImportError as exc:
        raise Unavailable(
            f"the PyTorch backend needs torch, which is not installed "
            f"(install the 'torch' extra): {exc}"
        ) from None


def instance_device(spec: InstanceSpec, model_name: str) -> Any:
    """The torch device an instance of ``spec`` runs on; None for KIND_MODEL (the
    model keeps the devices it was saved with)."""
    torch = require_torch()
    if spec.kind == "KIND_GPU":
        if not torch.cuda.is_available():
            raise Unavailable(
                f"instance '{spec.name}' of model '{model_name}' is KIND_GPU "
                "but this torch cannot use CUDA (a CPU-only build of torch?)"
            )
        return torch.device("cuda", spec.device_id)
    if spec.kind == "KIND_MODEL":
        return None
    return torch.device("cpu")
