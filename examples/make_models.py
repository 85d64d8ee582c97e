"""Build the ONNX files of the example model repository with the onnx helper API.

Run from anywhere: ``python examples/make_models.py``. The files are small and are
checked in; this script is how they were made and how to make them again.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

REPOSITORY = Path(__file__).resolve().parent / "model_repository"
OPSET = 17
IR_VERSION = 8  # readable by every onnxruntime release of the last years


def save(model: onnx.ModelProto, name: str) -> None:
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    path = REPOSITORY / name / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    print(f"wrote {path.relative_to(REPOSITORY.parent)}")


def simple() -> onnx.ModelProto:
    """Triton's classic 'simple': OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""

    def tensor(name: str):
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 16])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [tensor("INPUT0"), tensor("INPUT1")],
        [tensor("OUTPUT0"), tensor("OUTPUT1")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def identity(name: str, elem_type: int) -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 for a tensor of any length per batch item."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", elem_type, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", elem_type, ["batch", "n"])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def accumulate() -> onnx.ModelProto:
    """A stateful accumulator: OUTPUT = INPUT + INPUT_STATE, and the sum becomes the
    next INPUT_STATE of the sequence (Triton's implicit state, see config.pbtxt)."""

    def tensor(name: str):
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 1])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT", "INPUT_STATE"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["OUTPUT_STATE"]),
        ],
        "accumulate",
        [tensor("INPUT"), tensor("INPUT_STATE")],
        [tensor("OUTPUT"), tensor("OUTPUT_STATE")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


if __name__ == "__main__":
    save(simple(), "simple")
    save(identity("identity_fp32", TensorProto.FLOAT), "identity_fp32")
    save(identity("identity_bytes", TensorProto.STRING), "identity_bytes")
    save(accumulate(), "accumulate")
