"""Model warmup (``model_warmup`` in config.pbtxt), as Triton runs it.

Before a model version becomes READY, every instance executes every warmup
sample ``count`` times (once when ``count`` is 0): a batch of ``batch_size``
requests, each holding the sample's inputs. Inputs are zeros (``zero_data``;
empty strings for BYTES), random values (``random_data``) or the raw contents
of a file in the model's ``warmup/`` directory (``input_data_file``: the
tensor's bytes, or for BYTES Triton's length-prefixed elements). A sample that
fails makes the load fail with the reason; warmup is not counted in the
model's statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trionserve._generated.model_config_pb2 import DataType
from trionserve.core import datatypes
from trionserve.core.errors import InvalidArgument, TritonError, Unavailable
from trionserve.core.inference import InferenceRequest, Tensor
from trionserve.core.tensor_files import read_model_file, tensor_from_bytes, zeros

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig, ModelWarmup
    from trionserve.backends.base import ExecuteResult

WARMUP_FOLDER = "warmup"


@dataclass(frozen=True, slots=True)
class WarmupSample:
    name: str
    batch_size: int
    count: int
    inputs: dict[str, Tensor]  # one request's inputs

    def requests(self, model: str, version: int) -> list[InferenceRequest]:
        return [
            InferenceRequest(model, version, id=f"warmup_{self.name}", inputs=dict(self.inputs))
            for _ in range(self.batch_size)
        ]


def warmup_samples(config: ModelConfig, model_dir: Path) -> list[WarmupSample]:
    """The config's warmup samples with their data (blocking: reads files)."""
    samples = []
    inputs = {i.name: i for i in config.input}
    for index, warmup in enumerate(config.model_warmup):
        label = f"model '{config.name}': model_warmup '{warmup.name or index}'"
        if warmup.batch_size < 1:
            raise InvalidArgument(f"{label}: batch_size must be at least 1")
        if config.max_batch_size == 0 and warmup.batch_size != 1:
            raise InvalidArgument(
                f"{label}: batch_size must be 1 for a model that does not batch (max_batch_size 0)"
            )
        if config.max_batch_size and warmup.batch_size > config.max_batch_size:
            raise InvalidArgument(
                f"{label}: batch_size {warmup.batch_size} exceeds max_batch_size "
                f"{config.max_batch_size}"
            )
        tensors = {}
        for name, sample in warmup.inputs.items():
            if name not in inputs:
                raise InvalidArgument(f"{label}: '{name}' is not an input of the model")
            tensors[name] = _tensor(label, name, sample, config, model_dir)
        missing = [name for name, i in inputs.items() if not i.optional and name not in tensors]
        if missing:
            raise InvalidArgument(f"{label}: no data for input(s) {missing}")
        samples.append(WarmupSample(warmup.name, warmup.batch_size, warmup.count, tensors))
    return samples


def _tensor(
    label: str,
    name: str,
    sample: ModelWarmup.Input,
    config: ModelConfig,
    model_dir: Path,
) -> Tensor:
    kind = datatypes.from_config(DataType.Name(sample.data_type))
    dims = list(sample.dims)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{label}: input '{name}' needs fixed dims, got {dims}")
    shape = tuple(([1] if config.max_batch_size else []) + dims)
    source = sample.WhichOneof("input_data_type")
    if source == "zero_data" or source is None:
        data = zeros(shape, kind)
    elif source == "random_data":
        data = _random(kind, shape)
    else:
        where = f"{label}: input '{name}'"
        raw = read_model_file(model_dir, WARMUP_FOLDER, sample.input_data_file, where)
        data = tensor_from_bytes(kind, raw, shape, where)
    return Tensor(name, kind.wire, data)


def _random(kind: datatypes.DataType, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng()
    if kind.wire == "BYTES":
        return np.array(
            [rng.bytes(8) for _ in range(int(np.prod(shape, dtype=np.int64)))], dtype=np.object_
        ).reshape(shape)
    if kind.wire == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if kind.numpy.kind in "iu":
        info = np.iinfo(kind.numpy)
        return rng.integers(
            max(info.min, -128), min(info.max, 127), size=shape, endpoint=True
        ).astype(kind.numpy)
    return rng.random(size=shape).astype(kind.numpy)


def check_results(label: str, results: ExecuteResult | None) -> None:
    """Raise when a warmup execution answered any request with an error."""
    for result in results or ():
        if isinstance(result, TritonError):
            raise Unavailable(f"{label} failed: {result.message}")
