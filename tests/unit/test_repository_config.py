"""Model repository: config.pbtxt parsing, validation, defaults, JSON, versions, scan.

The valid configs are the examples of Triton's documentation (model_configuration.md,
batcher.md, ensemble_models.md, implicit_state_management.md, optimization.md,
ragged_batching.md, decoupled_models.md, response_cache.md and the docs' example
model repository), completed into whole configs where the docs show a fragment.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from google.protobuf import text_format

from tests.repository import write_model
from trionserve._generated import model_config_pb2 as mc
from trionserve.core.errors import InternalError, InvalidArgument, NotFound, Unavailable
from trionserve.observability.metrics import uncustomizable_families
from trionserve.repository.config import (
    infer_platform,
    model_config_from_json,
    model_config_to_json,
    normalize_model_config,
    read_model_config,
)
from trionserve.repository.config_validation import validate_model_config
from trionserve.repository.repository import ModelRepository
from trionserve.repository.versions import list_versions, missing_versions, select_versions

# -- helpers --------------------------------------------------------------------------


def load(model_dir: Path, override_json: str | None = None):
    """The registry's order: read, settle platform, normalise, validate."""
    config, max_batch_size_set = read_model_config(model_dir, override_json)
    infer_platform(config, model_dir)
    normalize_model_config(config)
    validate_model_config(config)
    return config, max_batch_size_set


# A batching TensorRT model the instance-group fragments of the docs are added to.
TRT_BASE = """
  platform: "tensorrt_plan"
  max_batch_size: 8
  input [
    {
      name: "input0"
      data_type: TYPE_FP32
      dims: [ 16 ]
    },
    {
      name: "input1"
      data_type: TYPE_FP32
      dims: [ 16 ]
    }
  ]
  output [
    {
      name: "output0"
      data_type: TYPE_FP32
      dims: [ 16 ]
    }
  ]
"""

SEQUENCE_IO = """
input [
  {
    name: "INPUT"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }
]
output [
  {
    name: "OUTPUT"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }
]
"""

DOC_EXAMPLES = {
    # model_configuration.md: minimal model configuration.
    "minimal": TRT_BASE,
    # model_configuration.md: a model that does not support batching.
    "no_batching": """
  platform: "tensorrt_plan"
  max_batch_size: 0
  input [
    {
      name: "input0"
      data_type: TYPE_FP32
      dims: [ 16 ]
    }
  ]
  output [
    {
      name: "output0"
      data_type: TYPE_FP32
      dims: [ 4 ]
    }
  ]
""",
    # model_configuration.md: reshape of a batched scalar input and output.
    "reshape": """
  platform: "onnxruntime_onnx"
  max_batch_size: 8
  input [
    {
      name: "in"
      data_type: TYPE_FP32
      dims: [ 1 ]
      reshape: { shape: [ ] }
    }
  ]
  output [
    {
      name: "out"
      data_type: TYPE_FP32
      dims: [ 1 ]
      reshape: { shape: [ ] }
    }
  ]
""",
    # model_configuration.md: shape tensors.
    "myshapetensormodel": """
  name: "myshapetensormodel"
  platform: "tensorrt_plan"
  max_batch_size: 8
  input [
    {
      name: "input0"
      data_type: TYPE_FP32
      dims: [ 1 , 3]
    },
    {
      name: "input1"
      data_type: TYPE_INT32
      dims: [ 2 ]
      is_shape_tensor: true
    }
  ]
  output [
    {
      name: "output0"
      data_type: TYPE_FP32
      dims: [ 1 , 3]
    }
  ]
""",
    # model_configuration.md: non-linear I/O formats.
    "mytensorrtmodel": """
  name: "mytensorrtmodel"
  platform: "tensorrt_plan"
  max_batch_size: 8
  input [
    {
      name: "INPUT0"
      data_type: TYPE_FP16
      dims: [ 3,224,224 ]
      is_non_linear_format_io: true
    },
    {
      name: "INPUT1"
      data_type: TYPE_FP16
      dims: [ 3,224,224 ]
      is_non_linear_format_io: true
    }
  ]
  output [
    {
      name: "OUTPUT0"
      data_type: TYPE_FP16
      dims: [ 1,3 ]
     }
  ]
""",
    # model_configuration.md: version policies.
    "version_all": TRT_BASE + "  version_policy: { all { }}\n",
    "version_latest": TRT_BASE + "version_policy: { latest: { num_versions: 2}}\n",
    "version_specific": TRT_BASE + "version_policy: { specific: { versions: [1,3]}}\n",
    # model_configuration.md: instance groups.
    "two_per_gpu": TRT_BASE + "instance_group [ { count: 2 kind: KIND_GPU } ]\n",
    "gpu_lists": TRT_BASE
    + """
  instance_group [
    {
      count: 1
      kind: KIND_GPU
      gpus: [ 0 ]
    },
    {
      count: 2
      kind: KIND_GPU
      gpus: [ 1, 2 ]
    }
  ]
""",
    "cpu_instances": TRT_BASE + "instance_group [ { count: 2 kind: KIND_CPU } ]\n",
    "host_policy": TRT_BASE
    + """
  instance_group [
    {
      count: 2
      kind: KIND_CPU
      host_policy: "policy_0"
    }
  ]
""",
    "rate_limiter": TRT_BASE
    + """
  instance_group [
    {
      count: 1
      kind: KIND_GPU
      gpus: [ 0, 1, 2 ]
      rate_limiter {
        resources [
          {
            name: "R1"
            count: 4
          },
          {
            name: "R2"
            global: True
            count: 2
          }
        ]
        priority: 2
      }
    }
  ]
""",
    # model_configuration.md: CUDA compute capability.
    "cc_model_filenames": TRT_BASE
    + """
cc_model_filenames [
  {
    key: "7.5"
    value: "resnet50_T4.plan"
  },
  {
    key: "8.0"
    value: "resnet50_A100.plan"
  }
]
""",
    # model_configuration.md: response cache.
    "response_cache": TRT_BASE + "response_cache {\n  enable: true\n}\n",
    # batcher.md: dynamic batcher settings.
    "dynamic_default": TRT_BASE + "  dynamic_batching { }\n",
    "dynamic_preferred": TRT_BASE
    + "  dynamic_batching {\n    preferred_batch_size: [ 4, 8 ]\n  }\n",
    "dynamic_delay": TRT_BASE
    + "  dynamic_batching {\n    max_queue_delay_microseconds: 100\n  }\n",
    # batcher.md: priority levels and queue policies (described in its text).
    "dynamic_priorities": TRT_BASE
    + """
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: false
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy {
    timeout_action: DELAY
    default_timeout_microseconds: 100000
    allow_timeout_override: true
    max_queue_size: 16
  }
  priority_queue_policy {
    key: 1
    value: { timeout_action: REJECT default_timeout_microseconds: 50000 max_queue_size: 8 }
  }
}
""",
    # optimization.md: dynamic batching with several instances.
    "dynamic_and_instances": TRT_BASE + "dynamic_batching { }\ninstance_group [ { count: 2 }]\n",
    # ragged_batching.md.
    "ragged": """
platform: "onnxruntime_onnx"
max_batch_size: 16
input [
  {
    name: "INPUT"
    data_type: TYPE_FP32
    dims: [ -1 ]
    allow_ragged_batch: true
  }
]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
batch_input [
  {
    kind: BATCH_ACCUMULATED_ELEMENT_COUNT
    target_name: "INDEX"
    data_type: TYPE_FP32
    source_input: "INPUT"
  }
]
dynamic_batching { }
""",
    # model_configuration.md (optional inputs).
    "optional_input": """
backend: "python"
max_batch_size: 4
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] optional: true }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
""",
    # docs/examples/model_repository/simple_sequence.
    "simple_sequence": """
name: "simple_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  control_input [
    {
      name: "START"
      control [
        {
          kind: CONTROL_SEQUENCE_START
          int32_false_true: [ 0, 1 ]
        }
      ]
    },
    {
      name: "READY"
      control [
        {
          kind: CONTROL_SEQUENCE_READY
          int32_false_true: [ 0, 1 ]
        }
      ]
    }
  ]
}
"""
    + SEQUENCE_IO
    + "instance_group [ { kind: KIND_CPU } ]\n",
    # docs/examples/model_repository/simple_dyna_sequence: oldest strategy, CORRID.
    "simple_dyna_sequence": """
name: "simple_dyna_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
    max_sequence_idle_microseconds: 10000000
    oldest {
      max_candidate_sequences: 1024
      max_queue_delay_microseconds: 10000
    }

  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "END"
      control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "READY"
      control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "CORRID"
      control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ]
    }
  ]
}
"""
    + SEQUENCE_IO
    + """
parameters [
  {
    key: "execute_delay_ms"
    value: { string_value: "3" }
  }
]
instance_group [
  {
    count: 2
    kind: KIND_CPU
  }
]
""",
    # architecture.md / implicit_state_management.md: direct strategy.
    "direct_stateful_model": """
name: "direct_stateful_model"
platform: "tensorrt_plan"
max_batch_size: 2
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  direct { }
  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "READY"
      control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ]
    }
  ]
}
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 100, 100 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 10 ] } ]
instance_group [
  {
    count: 2
  }
]
""",
    # architecture.md: oldest strategy on a TensorFlow SavedModel.
    "oldest_stateful_model": """
name: "oldest_stateful_model"
platform: "tensorflow_savedmodel"
max_batch_size: 2
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest
    {
      max_candidate_sequences: 4
    }
  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "END"
      control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "CORRID"
      control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ]
    }
  ]
}
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 100, 100 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 10 ] } ]
""",
    # implicit_state_management.md: implicit state with initial state.
    "implicit_state": """
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ] } ] }
  ]
  state [
    {
      input_name: "INPUT_STATE"
      output_name: "OUTPUT_STATE"
      data_type: TYPE_INT32
      dims: [ -1 ]
      initial_state: {
       data_type: TYPE_INT32
       dims: [ 1 ]
       zero_data: true
       name: "initial state"
      }
    },
    {
      input_name: "INPUT_STATE2"
      output_name: "OUTPUT_STATE2"
      data_type: TYPE_INT32
      dims: [ -1 ]
      initial_state: {
       data_type: TYPE_INT32
       dims: [ 1 ]
       data_file: "initial_state_data"
       name: "initial state"
      }
    }
  ]
}
"""
    + SEQUENCE_IO,
    # batcher.md: iterative sequences.
    "iterative_sequence": 'backend: "python"\nmax_batch_size: 4\n'
    + "sequence_batching {\n  iterative_sequence: true\n}\n"
    + SEQUENCE_IO
    + "model_transaction_policy { decoupled: True }\n",
    # ensemble_models.md.
    "ensemble_model": """
name: "ensemble_model"
platform: "ensemble"
max_batch_size: 1
input [
  {
    name: "IMAGE"
    data_type: TYPE_STRING
    dims: [ 1 ]
  }
]
output [
  {
    name: "CLASSIFICATION"
    data_type: TYPE_FP32
    dims: [ 1000 ]
  },
  {
    name: "SEGMENTATION"
    data_type: TYPE_FP32
    dims: [ 3, 224, 224 ]
  }
]
ensemble_scheduling {
  step [
    {
      model_name: "image_preprocess_model"
      model_version: -1
      input_map {
        key: "RAW_IMAGE"
        value: "IMAGE"
      }
      output_map {
        key: "PREPROCESSED_OUTPUT"
        value: "preprocessed_image"
      }
    },
    {
      model_name: "classification_model"
      model_version: -1
      input_map {
        key: "FORMATTED_IMAGE"
        value: "preprocessed_image"
      }
      output_map {
        key: "CLASSIFICATION_OUTPUT"
        value: "CLASSIFICATION"
      }
    },
    {
      model_name: "segmentation_model"
      model_version: -1
      input_map {
        key: "FORMATTED_IMAGE"
        value: "preprocessed_image"
      }
      output_map {
        key: "SEGMENTATION_OUTPUT"
        value: "SEGMENTATION"
      }
    }
  ]
}
""",
    # ensemble_models.md: max_inflight_requests.
    "ensemble_inflight": """
platform: "ensemble"
max_batch_size: 8
input [ { name: "IMAGE" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "RESULT" data_type: TYPE_FP32 dims: [ 1000 ] } ]
ensemble_scheduling {
  max_inflight_requests: 16

  step [
    {
      model_name: "dali_preprocess"
      model_version: -1
      input_map { key: "RAW_IMAGE", value: "IMAGE" }
      output_map { key: "PREPROCESSED_IMAGE", value: "preprocessed" }
    },
    {
      model_name: "onnx_inference"
      model_version: -1
      input_map { key: "INPUT", value: "preprocessed" }
      output_map { key: "OUTPUT", value: "RESULT" }
    }
  ]
}
""",
    # optimization.md: ONNX with TensorRT / OpenVINO execution accelerators.
    "gpu_accelerator": TRT_BASE.replace("tensorrt_plan", "onnxruntime_onnx")
    + """
optimization { execution_accelerators {
  gpu_execution_accelerator : [ {
    name : "tensorrt"
    parameters { key: "precision_mode" value: "FP16" }
    parameters { key: "max_workspace_size_bytes" value: "1073741824" }
    }]
}}
""",
    "cpu_accelerator": TRT_BASE.replace("tensorrt_plan", "onnxruntime_onnx")
    + """
optimization { execution_accelerators {
  cpu_execution_accelerator : [ {
    name : "openvino"
  }]
}}
""",
    # model_configuration.md: model warmup (ModelWarmup, as in L0_warmup).
    "model_warmup": TRT_BASE
    + """
model_warmup [
  {
    name: "zero_warmup"
    batch_size: 8
    inputs { key: "input0" value: { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } }
    inputs { key: "input1" value: { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } }
  },
  {
    name: "random_warmup"
    batch_size: 1
    count: 3
    inputs { key: "input0" value: { data_type: TYPE_FP32 dims: [ 16 ] random_data: true } }
    inputs { key: "input1" value: { data_type: TYPE_FP32 dims: [ 16 ] input_data_file: "raw_input1" } }
  }
]
""",
    # decoupled_models.md.
    "decoupled": """
backend: "python"
max_batch_size: 0
model_transaction_policy {
  decoupled: True
}
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
""",
    # Triton accepts dynamic batching on a model with max_batch_size 0.
    "dynamic_no_batching": """
platform: "onnxruntime_onnx"
input [ { name: "A" data_type: TYPE_FP32 dims: [ 2, -1, 6 ] reshape: { shape: [ 2, -1, 3, 2 ] } } ]
output [ { name: "B" data_type: TYPE_STRING dims: [ 1 ] } ]
dynamic_batching { }
""",
}


@pytest.mark.parametrize("name", sorted(DOC_EXAMPLES))
def test_documented_configs_parse_and_validate(tmp_path, name):
    model_dir = write_model(tmp_path, name, DOC_EXAMPLES[name])
    config, _ = load(model_dir)
    assert config.name == name
    assert config.HasField("version_policy")
    if config.platform == "ensemble":
        assert not config.instance_group and config.backend == ""
    else:
        assert config.instance_group and all(g.count >= 1 for g in config.instance_group)


def test_documented_configs_keep_their_values(tmp_path):
    config, _ = load(
        write_model(tmp_path, "simple_dyna_sequence", DOC_EXAMPLES["simple_dyna_sequence"])
    )
    batching = config.sequence_batching
    assert batching.max_sequence_idle_microseconds == 10_000_000
    assert batching.oldest.max_candidate_sequences == 1024
    assert batching.oldest.preferred_batch_size == [8]  # Triton's default: max_batch_size
    assert [c.name for c in batching.control_input] == ["START", "END", "READY", "CORRID"]
    assert batching.control_input[3].control[0].data_type == mc.TYPE_UINT64
    assert config.parameters["execute_delay_ms"].string_value == "3"
    assert config.backend == "onnxruntime"

    config, _ = load(write_model(tmp_path, "rate_limiter", DOC_EXAMPLES["rate_limiter"]))
    resources = config.instance_group[0].rate_limiter.resources
    # "global" is a Python keyword, hence getattr.
    assert [(r.name, getattr(r, "global"), r.count) for r in resources] == [
        ("R1", False, 4),
        ("R2", True, 2),
    ]

    config, _ = load(
        write_model(tmp_path, "dynamic_priorities", DOC_EXAMPLES["dynamic_priorities"])
    )
    batching = config.dynamic_batching
    assert batching.default_queue_policy.timeout_action == mc.ModelQueuePolicy.DELAY
    assert batching.priority_queue_policy[1].max_queue_size == 8

    config, _ = load(write_model(tmp_path, "gpu_accelerator", DOC_EXAMPLES["gpu_accelerator"]))
    accelerator = config.optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert accelerator.name == "tensorrt"
    assert accelerator.parameters["precision_mode"] == "FP16"


# -- invalid configs -------------------------------------------------------------------

ONNX_IO = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

SEQ_BASE = ONNX_IO + "sequence_batching {\n"

INVALID = {
    "negative_max_batch_size": (
        ONNX_IO.replace("max_batch_size: 8", "max_batch_size: -1"),
        "'max_batch_size' must be non-negative value for bad",
    ),
    "input_without_name": (
        ONNX_IO + "input [ { data_type: TYPE_FP32 dims: [ 1 ] } ]",
        "model input must specify 'name' for bad",
    ),
    "duplicate_input": (
        ONNX_IO + 'input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] } ]',
        "input 'A' is declared more than once",
    ),
    "duplicate_output": (
        ONNX_IO + 'output [ { name: "B" data_type: TYPE_FP32 dims: [ 1 ] } ]',
        "output 'B' is declared more than once",
    ),
    "no_data_type": (
        ONNX_IO.replace('name: "A" data_type: TYPE_FP32', 'name: "A"'),
        "model input 'A' must specify 'data_type' for bad",
    ),
    "empty_dims": (
        ONNX_IO.replace("dims: [ 4 ] } ]\noutput", "dims: [ ] } ]\noutput"),
        "model input 'A' must specify 'dims' for bad (dims: [ 1 ] with reshape: { shape: [ ] } for a scalar)",
    ),
    "empty_output_dims": (
        ONNX_IO.replace('"B" data_type: TYPE_FP32 dims: [ 4 ]', '"B" data_type: TYPE_FP32'),
        "model output 'B' must specify 'dims' for bad (dims: [ 1 ] with reshape: { shape: [ ] } for a scalar)",
    ),
    "zero_dim": (
        ONNX_IO.replace("dims: [ 4 ] } ]\noutput", "dims: [ 4, 0 ] } ]\noutput"),
        "model input 'A' dimension must be integer >= 1, or -1 to indicate a variable-size dimension for bad",
    ),
    "dim_below_wildcard": (
        ONNX_IO.replace("dims: [ 4 ] } ]\noutput", "dims: [ -2 ] } ]\noutput"),
        "model input 'A' dimension must be integer >= 1, or -1 to indicate a variable-size dimension for bad",
    ),
    "reshape_count": (
        ONNX_IO.replace(
            "dims: [ 4 ] } ]\noutput", "dims: [ 4 ] reshape { shape: [ 3 ] } } ]\noutput"
        ),
        "model input 'A' has different size for dims and reshape for bad",
    ),
    "reshape_wildcard_trunks": (
        ONNX_IO.replace(
            "dims: [ 4 ] } ]\noutput", "dims: [ 2, -1 ] reshape { shape: [ -1, 3 ] } } ]\noutput"
        ),
        "model input 'A' has different size for dims and reshape for bad",
    ),
    "reshape_wildcard_number": (
        ONNX_IO.replace(
            "dims: [ 4 ] } ]\noutput",
            "dims: [ 2, -1 ] reshape { shape: [ 2, -1, -1 ] } } ]\noutput",
        ),
        "model input 'A' has different number of variable-size dimensions for dims and reshape for bad",
    ),
    "reshape_zero": (
        ONNX_IO.replace(
            '"B" data_type: TYPE_FP32 dims: [ 4 ]',
            '"B" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 0 ] }',
        ),
        "model output 'B' reshape dimensions must be integer >= 1, or -1 to indicate a variable-size dimension for bad",
    ),
    "scalar_reshape_without_batching": (
        ONNX_IO.replace("max_batch_size: 8", "max_batch_size: 0").replace(
            "dims: [ 4 ] } ]\noutput", "dims: [ 1 ] reshape { shape: [ ] } } ]\noutput"
        ),
        "model input 'A' cannot have empty reshape for non-batching model as scalar tensors are not supported for bad",
    ),
    "format_needs_three_dims": (
        ONNX_IO.replace(
            "dims: [ 4 ] } ]\noutput", "format: FORMAT_NCHW dims: [ 3, 4 ] } ]\noutput"
        ),
        "model input NHWC/NCHW require 3 dims for bad",
    ),
    "shape_tensor_not_tensorrt": (
        ONNX_IO.replace("dims: [ 4 ] } ]\noutput", "dims: [ 4 ] is_shape_tensor: true } ]\noutput"),
        "shape tensors are only supported for TensorRT platform for bad",
    ),
    "batch_input_unknown_source": (
        ONNX_IO
        + 'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_INT32 source_input: "X" } ]',
        "unknown source input name 'X' for bad",
    ),
    "instance_count_negative": (
        ONNX_IO + "instance_group [ { count: -1 kind: KIND_CPU } ]",
        "instance_group 'bad_0': count must be >= 1",
    ),
    "cpu_group_with_gpus": (
        ONNX_IO + 'instance_group [ { name: "g" kind: KIND_CPU gpus: [ 0 ] } ]',
        "instance group g of model bad has kind KIND_CPU but specifies one or more GPUs",
    ),
    "profile_not_tensorrt": (
        ONNX_IO + 'instance_group [ { kind: KIND_GPU profile: [ "0" ] } ]',
        "instance group bad_0 of model bad and platform onnxruntime_onnxspecifies profile field which is only supported for TensorRT models",
    ),
    "specific_version_zero": (
        ONNX_IO + "version_policy { specific { versions: [ 1, 0 ] } }",
        "version_policy.specific.versions must be positive, got 0",
    ),
    "latest_zero_versions": (
        ONNX_IO + "version_policy { latest { } }",
        "version_policy.latest.num_versions must be >= 1",
    ),
    "preferred_exceeds_max": (
        ONNX_IO + "dynamic_batching { preferred_batch_size: [ 4, 16 ] }",
        "dynamic batching preferred size must be <= max batch size for bad",
    ),
    "preferred_without_batching": (
        ONNX_IO.replace("max_batch_size: 8", "max_batch_size: 0")
        + "dynamic_batching { preferred_batch_size: [ 4 ] }",
        "dynamic batching preferred size must be <= max batch size for bad",
    ),
    "preferred_zero": (
        ONNX_IO + "dynamic_batching { preferred_batch_size: [ 0 ] }",
        "dynamic batching preferred size must be positive for bad",
    ),
    "default_priority_level_unset": (
        ONNX_IO + "dynamic_batching { priority_levels: 3 }",
        "default priority level must be in range [1, 3] for bad",
    ),
    "default_priority_level_too_high": (
        ONNX_IO + "dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
        "default priority level must be in range [1, 2] for bad",
    ),
    "priority_queue_policy_level": (
        ONNX_IO
        + "dynamic_batching { priority_levels: 2 default_priority_level: 1 "
        + "priority_queue_policy { key: 5 value { max_queue_size: 1 } } }",
        "priority queue policy must have priority level in range [1, 2] for bad",
    ),
    "preserve_ordering_priorities": (
        ONNX_IO
        + "dynamic_batching { preserve_ordering: true priority_levels: 2 default_priority_level: 1 }",
        "Only one priority level is allowed when 'preserve_ordering' is true for bad",
    ),
    "preserve_ordering_delay": (
        ONNX_IO
        + "dynamic_batching { preserve_ordering: true "
        + "default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 10 } }",
        "Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true for bad",
    ),
    "control_without_values": (
        SEQ_BASE + 'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ] }',
        "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for CONTROL_SEQUENCE_START for bad",
    ),
    "control_three_values": (
        SEQ_BASE
        + 'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1, 2 ] } ] } ] }',
        "sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_START for bad",
    ),
    "control_two_kinds_of_values": (
        SEQ_BASE
        + 'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_END '
        + "int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ] } ] } ] }",
        "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and 'bool_false_true' for CONTROL_SEQUENCE_END for bad",
    ),
    "control_twice": (
        SEQ_BASE
        + 'control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
        + '{ name: "T" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ] }',
        "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors for bad",
    ),
    "corrid_type": (
        SEQ_BASE
        + 'control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ] }',
        "unexpected data type for control CONTROL_SEQUENCE_CORRID for bad. Allowed data types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING",
    ),
    "oldest_preferred": (
        SEQ_BASE + "oldest { preferred_batch_size: [ 32 ] } }",
        "sequence batching preferred batch size must be <= max batch size for bad",
    ),
    "state_without_names": (
        SEQ_BASE + "state [ { data_type: TYPE_INT32 dims: [ 1 ] } ] }",
        "sequence_batching.state 0: input_name and output_name must be set",
    ),
    "sequence_with_cache": (
        SEQ_BASE + "}\nresponse_cache { enable: true }",
        "Response Cache does not currently support model bad with sequence batching "
        "scheduler. Please disable the response cache.",
    ),
    "decoupled_with_cache": (
        ONNX_IO + "model_transaction_policy { decoupled: true }\nresponse_cache { enable: true }",
        "Response Cache does not currently support model bad with 'decoupled' "
        "transaction policy. Please disable the response cache.",
    ),
    "ensemble_without_scheduling": (
        ONNX_IO.replace("onnxruntime_onnx", "ensemble"),
        "ensemble scheduling must be set for ensemble bad whose platform is ensemble",
    ),
    "scheduling_without_ensemble": (
        ONNX_IO
        + 'ensemble_scheduling { step [ { model_name: "m" input_map { key: "x" value: "A" } output_map { key: "y" value: "B" } } ] }',
        "ensemble scheduling cannot be set for model 'bad' whose platform is not ensemble",
    ),
}

ENSEMBLE_BASE = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def ensemble(steps: str, extra: str = "") -> str:
    return ENSEMBLE_BASE + extra + "ensemble_scheduling { step [ " + steps + " ] }\n"


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f'input_map {{ key: "{k}" value: "{v}" }} ' for k, v in inputs.items())
    maps += "".join(f'output_map {{ key: "{k}" value: "{v}" }} ' for k, v in outputs.items())
    return f'{{ model_name: "{model}" {maps}}}'


INVALID.update(
    {
        "ensemble_with_backend": (
            ensemble(step("m", {"x": "IN"}, {"y": "OUT"})) + 'backend: "onnxruntime"',
            "Ensemble model 'bad' must have platform type 'ensemble' and empty backend type",
        ),
        "ensemble_with_instance_group": (
            ensemble(step("m", {"x": "IN"}, {"y": "OUT"}), "instance_group [ { count: 1 } ]\n"),
            "instance group should not be specified for ensemble 'bad'",
        ),
        "ensemble_no_steps": (
            ENSEMBLE_BASE + "ensemble_scheduling { }",
            "must specify 'step' for ensemble 'bad'",
        ),
        "ensemble_step_without_model": (
            ensemble('{ input_map { key: "x" value: "IN" } output_map { key: "y" value: "OUT" } }'),
            "must specify 'model_name' in step 0 of ensemble 'bad'",
        ),
        "ensemble_step_without_outputs": (
            ensemble(step("m", {"x": "IN"}, {})),
            "must specify 'output_map' in step 0 of ensemble 'bad'",
        ),
        "ensemble_unknown_tensor": (
            ensemble(step("m", {"x": "IN", "z": "nowhere"}, {"y": "OUT"})),
            "output 'OUT' for ensemble 'bad' is not written: at least one of its depending tensors, 'nowhere', is not connected",
        ),
        "ensemble_output_not_written": (
            ensemble(
                step("m", {"x": "IN"}, {"y": "other"})
                + ", "
                + step("n", {"x": "other"}, {"y": "OUT2"})
            ),
            "ensemble output 'OUT' for ensemble bad' is not used",
        ),
        "ensemble_input_unused": (
            ensemble(step("m", {"x": "IN"}, {"y": "OUT"})).replace(
                'input [ { name: "IN"',
                'input [ { name: "EXTRA" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "IN"',
            ),
            "ensemble input 'EXTRA' for ensemble bad' is not used",
        ),
        "ensemble_tensor_written_twice": (
            ensemble(
                step("m", {"x": "IN"}, {"y": "OUT"}) + ", " + step("n", {"x": "IN"}, {"y": "OUT"})
            ),
            "ensemble tensor 'OUT' can appear in an output map only once for ensemble 'bad' step 1",
        ),
        "ensemble_dangling_tensor": (
            ensemble(step("m", {"x": "IN"}, {"y": "OUT", "z": "unused"})),
            "ensemble tensor 'unused' is unused in ensemble 'bad'",
        ),
        "ensemble_cycle": (
            ensemble(
                step("m", {"x": "IN", "w": "b"}, {"y": "a"})
                + ", "
                + step("n", {"x": "a"}, {"y": "b"})
                + ", "
                + step("o", {"x": "a"}, {"y": "OUT"})
            ),
            "output 'OUT' for ensemble 'bad' is not written: at least one of its depending tensors, 'b', is not connected",
        ),
    }
)


# qa/L0_model_config/model_metrics/invalid_config: Triton's words (core
# src/model_config_utils.cc ValidateModelMetrics).
FAMILY = 'metric_identifier { family: "nv_inference_first_response_histogram_ms" }'
BUCKETS = "histogram_options { buckets: [ 1, 2, 4, 8 ] }"
INVALID.update(
    {
        f"metrics_{case}": (
            ONNX_IO + f"model_metrics {{ metric_control [ {{ {control} }} ] }}",
            expected,
        )
        for case, control, expected in (
            ("no_metric_identifier", BUCKETS, "metric control must specify 'metric_identifier'"),
            (
                "no_metric_family",
                "metric_identifier { } " + BUCKETS,
                "metric identifier must specify non-empty 'family'",
            ),
            (
                "empty_metric_family",
                'metric_identifier { family: "" } ' + BUCKETS,
                "metric identifier must specify non-empty 'family'",
            ),
            (
                "no_histogram_options",
                FAMILY,
                "metric control must specify 'histogram_options'",
            ),
            (
                "no_buckets",
                FAMILY + " histogram_options { }",
                "histogram options must specify non-empty 'buckets'",
            ),
            (
                "empty_buckets",
                FAMILY + " histogram_options { buckets: [ ] }",
                "histogram options must specify non-empty 'buckets'",
            ),
        )
    }
)


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_configs_name_model_and_field(tmp_path, case):
    text, expected = INVALID[case]
    model_dir = write_model(tmp_path, "bad", text)
    with pytest.raises(InvalidArgument) as info:
        load(model_dir)
    assert re.search(r"\bbad\b", info.value.message)  # names the model
    assert expected in info.value.message


def test_valid_reshape_with_wildcards(tmp_path):
    # Triton's own example: [2, 4, -1, 6] -> [8, -1, 1, 6] is a valid reshape.
    text = ONNX_IO.replace(
        "dims: [ 4 ] } ]\noutput",
        "dims: [ 2, 4, -1, 6 ] reshape { shape: [ 8, -1, 1, 6 ] } } ]\noutput",
    )
    load(write_model(tmp_path, "ok", text))


def test_model_metrics_of_any_family_load_and_only_one_is_customizable(tmp_path):
    # qa/L0_model_config model_metrics/valid_config and valid_config_with_warn: both
    # load; Triton warns for a family it cannot customise (metric_model_reporter.cc).
    controls = ", ".join(
        f'{{ metric_identifier {{ family: "{family}" }} {BUCKETS} }}'
        for family in ("nv_inference_first_response_histogram_ms", "nv_inference_request_success")
    )
    text = ONNX_IO + f"model_metrics {{ metric_control [ {controls} ] }}"
    config, _ = load(write_model(tmp_path, "ok", text))
    assert uncustomizable_families(config) == ["nv_inference_request_success"]


# -- reading --------------------------------------------------------------------------


def test_missing_config_gives_empty_config_named_after_directory(tmp_path):
    config, max_batch_size_set = read_model_config(write_model(tmp_path, "auto", None))
    assert config == mc.ModelConfig(name="auto")
    assert max_batch_size_set is False


def test_name_must_match_directory(tmp_path):
    model_dir = write_model(tmp_path, "simple", 'name: "other"\n' + ONNX_IO)
    with pytest.raises(
        InvalidArgument,
        match="model name 'other' in config.pbtxt does not match the directory name 'simple'",
    ):
        read_model_config(model_dir)


def test_a_poll_validates_the_config_before_checking_its_name(tmp_path):
    """Triton normalizes and validates a polled config, then checks its name
    (core model_repository_manager.cc InitializeModelInfo): a config that is both
    invalid and misnamed reports what is invalid; a valid one, the name in
    Triton's words. Neither needs a version directory (Triton polls first)."""
    from trionserve.actors.registry_entries import prepare_model

    invalid = 'name: "other" platform: "ensemble" max_batch_size: 8\n' + ONNX_IO.split("\n", 3)[3]
    with pytest.raises(
        InvalidArgument, match="^ensemble scheduling must be set for ensemble other"
    ):
        prepare_model(write_model(tmp_path, "invalid", invalid), True, None)
    with pytest.raises(InvalidArgument) as caught:
        prepare_model(write_model(tmp_path, "valid", 'name: "other"\n' + ONNX_IO), True, None)
    assert caught.value.message == (
        "unexpected directory name 'valid' for model 'other', directory name must equal model name"
    )


def test_parse_error_names_model_file_line_and_column(tmp_path):
    model_dir = write_model(
        tmp_path, "broken", 'platform: "onnxruntime_onnx"\n  max_batch_size: "eight"\n'
    )
    with pytest.raises(InvalidArgument) as info:
        read_model_config(model_dir)
    message = info.value.message
    assert message.startswith(
        "model 'broken': failed to parse broken/config.pbtxt: line 2, column 19: "
    )
    assert "integer" in message


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("-5", "Expected integer, got: -"),
        ('"invalid_value"', 'Expected integer, got: "invalid_value"'),
        ("12345678901", "Integer out of range (12345678901)"),
    ],
)
def test_integer_errors_in_protobufs_cpp_words(tmp_path, value, words):
    # Triton reads config.pbtxt with protobuf's C++ parser; qa/L0_simple_ensemble
    # looks for its words (max_inflight_requests is a uint32).
    text = f"ensemble_scheduling {{\n  max_inflight_requests: {value}\n}}\n"
    with pytest.raises(InvalidArgument) as info:
        read_model_config(write_model(tmp_path, "m", text))
    assert info.value.message.endswith(words)


def test_parse_error_writes_protobufs_own_unescaped_line(tmp_path, capfd):
    # Triton's process prints the C++ parser's error through protobuf's logger on
    # stderr, quotes as they are, beside its own escaped record (Triton 2.51:
    # "[libprotobuf ERROR .../text_format.cc:337] Error parsing text-format
    # inference.ModelConfig: 6:24: ..."); qa/L0_simple_ensemble greps it.
    text = 'ensemble_scheduling {\n  max_inflight_requests: "invalid_value"\n}\n'
    with pytest.raises(InvalidArgument):
        read_model_config(write_model(tmp_path, "m", text))
    err = capfd.readouterr().err
    assert err == (
        "[libprotobuf ERROR google/protobuf/text_format.cc:337] Error parsing text-format "
        'inference.ModelConfig: 2:26: Expected integer, got: "invalid_value"\n'
    )


def test_unknown_field_is_a_parse_error(tmp_path):
    with pytest.raises(InvalidArgument, match=r"line 1, column 1: .*no_such_field"):
        read_model_config(write_model(tmp_path, "m", "no_such_field: 1\n"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_batch_size: 0\n", True),
        ("max_batch_size : 8\n", True),
        ("max_batch_size: 8 # the largest batch\n", True),
        ('platform: "onnxruntime_onnx"\n', False),
        ('# max_batch_size: 8\nplatform: "onnxruntime_onnx"\n', False),
        (
            'parameters { key: "max_batch_size" value { string_value: "max_batch_size: 4" } }\n',
            False,
        ),
    ],
)
def test_max_batch_size_presence(tmp_path, text, expected):
    _, max_batch_size_set = read_model_config(write_model(tmp_path, "m", text))
    assert max_batch_size_set is expected


def test_json_override_replaces_config_file(tmp_path):
    model_dir = write_model(tmp_path, "simple", ONNX_IO, versions=[1])
    override = json.dumps(
        {
            "backend": "onnxruntime",
            "max_batch_size": 0,
            "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [2]}],
            "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": ["2"]}],
        }
    )
    config, max_batch_size_set = load(model_dir, override)
    assert config.name == "simple"
    assert max_batch_size_set is True
    assert [i.name for i in config.input] == ["X"]
    assert config.platform == "onnxruntime_onnx"
    assert list(config.output[0].dims) == [2]

    _, max_batch_size_set = read_model_config(model_dir, '{"backend": "python"}')
    assert max_batch_size_set is False


def test_json_override_in_protobufs_legacy_syntax(tmp_path):
    # Triton reads an override with protobuf's JsonStringToMessage, whose legacy
    # syntax takes bare-word keys and single-quoted strings
    # (qa/L0_iterative_sequence test_backlog_fill: `direct: { ... }`).
    model_dir = write_model(tmp_path, "simple", ONNX_IO)
    override = (
        '{"backend": \'onnxruntime\', "sequence_batching": {"iterative_sequence": true, '
        'direct: {"max_queue_delay_microseconds": 10000000}}, max_batch_size: 2}'
    )
    config, max_batch_size_set = read_model_config(model_dir, override)
    assert config.sequence_batching.direct.max_queue_delay_microseconds == 10000000
    assert config.sequence_batching.iterative_sequence
    assert config.max_batch_size == 2 and max_batch_size_set is True


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("{not json", "failed to load 'simple': invalid config override"),
        ("{direct: }", "invalid config override: Expecting property name enclosed in double"),
        ("[1, 2]", "failed to load 'simple': invalid config override: expected a JSON object"),
        ('{"no_such_field": 1}', "no_such_field"),
        ('{"max_batch_size": "many"}', "failed to load 'simple': invalid config override"),
        (
            '{"name": "other"}',
            "model name 'other' in the config override does not match the directory name 'simple'",
        ),
    ],
)
def test_json_override_errors(tmp_path, override, expected):
    model_dir = write_model(tmp_path, "simple", ONNX_IO)
    with pytest.raises(InvalidArgument) as info:
        read_model_config(model_dir, override)
    assert expected in info.value.message


# -- platform and backend ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "platform", "backend", "filename"),
    [
        (["1/model.onnx"], "onnxruntime_onnx", "onnxruntime", "model.onnx"),
        (["1/model.onnx/model.onnx"], "onnxruntime_onnx", "onnxruntime", "model.onnx"),
        # Triton names no file for a TorchScript model found by its file
        # (model_config_utils.cc:1222-1253): the backend reads model.pt.
        (["1/model.pt"], "pytorch_libtorch", "pytorch", ""),
        (["1/model.plan"], "tensorrt_plan", "tensorrt", "model.plan"),
        (["1/model.py"], "", "python", "model.py"),
        (
            ["1/model.savedmodel/saved_model.pb"],
            "tensorflow_savedmodel",
            "tensorflow",
            "model.savedmodel",
        ),
        (["1/model.graphdef"], "tensorflow_graphdef", "tensorflow", "model.graphdef"),
        (["1/notes.txt", "2/model.onnx"], "onnxruntime_onnx", "onnxruntime", "model.onnx"),
    ],
)
def test_platform_from_model_file(tmp_path, files, platform, backend, filename):
    model_dir = write_model(tmp_path, "m", None, files=dict.fromkeys(files, b""))
    config, _ = read_model_config(model_dir)
    infer_platform(config, model_dir)
    assert (config.platform, config.backend, config.default_model_filename) == (
        platform,
        backend,
        filename,
    )


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"platform": "onnxruntime_onnx"}, ("onnxruntime_onnx", "onnxruntime")),
        ({"backend": "onnxruntime"}, ("onnxruntime_onnx", "onnxruntime")),
        ({"platform": "pytorch_libtorch"}, ("pytorch_libtorch", "pytorch")),
        ({"backend": "pytorch"}, ("pytorch_libtorch", "pytorch")),
        ({"platform": "tensorrt_plan"}, ("tensorrt_plan", "tensorrt")),
        ({"backend": "tensorrt"}, ("tensorrt_plan", "tensorrt")),
        ({"platform": "tensorflow_savedmodel"}, ("tensorflow_savedmodel", "tensorflow")),
        ({"platform": "tensorflow_graphdef"}, ("tensorflow_graphdef", "tensorflow")),
        ({"backend": "python"}, ("", "python")),
        ({"backend": "identity"}, ("", "identity")),
        ({"platform": "ensemble"}, ("ensemble", "")),
        ({"default_model_filename": "resnet.onnx"}, ("onnxruntime_onnx", "onnxruntime")),
    ],
)
def test_platform_and_backend_imply_each_other(tmp_path, given, expected):
    config = mc.ModelConfig(name="m", **given)
    infer_platform(config, tmp_path)
    assert (config.platform, config.backend) == expected


@pytest.mark.parametrize(
    ("given", "filename"),
    [
        ({"backend": "pytorch"}, "model.pt"),
        ({"platform": "pytorch_libtorch"}, ""),
        ({"platform": "pytorch_libtorch", "backend": "pytorch"}, ""),
        ({"platform": "torch_aoti"}, "model.pt2"),
    ],
)
def test_a_torchscript_file_is_named_only_for_a_backend_without_platform(tmp_path, given, filename):
    # core model_config_utils.cc:1245-1258 AutoCompleteBackendFields.
    config = mc.ModelConfig(name="m", **given)
    infer_platform(config, tmp_path)
    assert config.default_model_filename == filename


def test_tensorflow_backend_platform_from_file(tmp_path):
    model_dir = write_model(tmp_path, "tf", None, files={"1/model.graphdef": b""})
    config = mc.ModelConfig(name="tf", backend="tensorflow")
    infer_platform(config, model_dir)
    assert config.platform == "tensorflow_graphdef"
    with pytest.raises(InvalidArgument, match="backend 'tensorflow' needs platform"):
        infer_platform(mc.ModelConfig(name="tf", backend="tensorflow"), tmp_path)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            {},
            "Invalid model name: Could not determine backend for model 'm' with no backend "
            "in model configuration. Expected model name of the form 'model.<backend_name>'.",
        ),
        # Triton's words (model_config_utils.cc ValidateModelConfig), as qa/L0_model_config
        # greps them; default_model_filename names the backend of an unknown platform.
        ({"platform": "caffe2_netdef"}, "unexpected platform type 'caffe2_netdef' for m"),
        (
            {"platform": "onnxruntime_onnx", "backend": "pytorch"},
            "unexpected 'platform' and 'backend' pair, got:onnxruntime_onnx, pytorch",
        ),
        (
            {"platform": "onnxruntim", "default_model_filename": "model.onnx"},
            "unexpected 'platform' and 'backend' pair, got:onnxruntim, onnxruntime",
        ),
        (
            {"platform": "ensemble", "backend": "python"},
            "Ensemble model 'm' must have platform type 'ensemble' and empty backend type",
        ),
    ],
)
def test_platform_errors(tmp_path, given, expected):
    model_dir = write_model(tmp_path, "m", None, files={"1/README": b""})
    with pytest.raises(InvalidArgument) as info:
        infer_platform(mc.ModelConfig(name="m", **given), model_dir)
    assert expected in info.value.message


# -- normalisation --------------------------------------------------------------------


def test_normalize_fills_triton_defaults():
    config = mc.ModelConfig(
        name="simple", backend="onnxruntime", platform="onnxruntime_onnx", max_batch_size=8
    )
    config.dynamic_batching.SetInParent()
    normalize_model_config(config)
    assert config.version_policy.WhichOneof("policy_choice") == "latest"
    assert config.version_policy.latest.num_versions == 1
    assert list(config.dynamic_batching.preferred_batch_size) == [8]
    assert config.optimization.input_pinned_memory.enable
    [group] = config.instance_group
    assert (group.name, group.count, group.kind) == ("simple", 1, mc.ModelInstanceGroup.KIND_AUTO)


def test_normalize_instance_groups():
    config = mc.ModelConfig(name="simple", backend="onnxruntime")
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU)  # count 0: default
    config.instance_group.add(name="gpus", count=3, kind=mc.ModelInstanceGroup.KIND_GPU)
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_GPU)
    config.version_policy.all.SetInParent()
    config.sequence_batching.oldest.SetInParent()
    normalize_model_config(config)
    assert [(g.name, g.count) for g in config.instance_group] == [
        ("simple_0", 2),  # Triton: two CPU instances for onnxruntime by default
        ("gpus", 3),
        ("simple_2", 1),
    ]
    assert config.version_policy.WhichOneof("policy_choice") == "all"
    assert config.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    assert list(config.sequence_batching.oldest.preferred_batch_size) == []  # max_batch_size 0


def test_normalize_leaves_ensembles_without_instances(tmp_path):
    config, _ = load(write_model(tmp_path, "ensemble_model", DOC_EXAMPLES["ensemble_model"]))
    assert not config.instance_group
    assert not config.HasField("optimization")


# -- JSON -------------------------------------------------------------------------------


def test_model_config_to_json_uses_numbers_for_64_bit_fields(tmp_path):
    config, _ = load(
        write_model(tmp_path, "dynamic_priorities", DOC_EXAMPLES["dynamic_priorities"])
    )
    config.input[0].reshape.shape.extend([4, -1])
    obj = model_config_to_json(config)
    json.dumps(obj)
    assert obj["name"] == "dynamic_priorities"
    assert obj["max_batch_size"] == 8
    assert obj["input"][0]["dims"] == [16]
    assert obj["input"][0]["reshape"]["shape"] == [4, -1]
    assert obj["output"][0]["dims"] == [16]
    batching = obj["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 100
    assert batching["priority_levels"] == 2
    assert batching["default_priority_level"] == 2
    assert batching["default_queue_policy"]["default_timeout_microseconds"] == 100000
    assert batching["default_queue_policy"]["timeout_action"] == "DELAY"
    # Maps stay maps with string keys; their 64-bit values become numbers.
    assert batching["priority_queue_policy"] == {
        "1": {
            "timeout_action": "REJECT",
            "default_timeout_microseconds": 50000,
            "allow_timeout_override": False,
            "max_queue_size": 8,
        }
    }
    # Fields without presence are printed with their defaults, as Triton does.
    assert obj["input"][0]["optional"] is False
    assert obj["instance_group"][0]["count"] == 1


def test_model_config_to_json_prints_fields_in_the_protos_order(tmp_path):
    # Triton 2.51's GET .../config for a python model with this batching printed
    # its keys in model_config.proto's order, defaults in place (protobuf's C++
    # printer); qa/L0_config_json greps a policy's JSON whole.
    config, _ = load(
        write_model(tmp_path, "dynamic_priorities", DOC_EXAMPLES["dynamic_priorities"])
    )
    obj = model_config_to_json(config)
    assert list(obj)[:6] == [
        "name",
        "platform",
        "backend",
        "runtime",
        "version_policy",
        "max_batch_size",
    ]
    assert list(obj["input"][0])[:4] == ["name", "data_type", "format", "dims"]
    assert list(obj["instance_group"][0])[:3] == ["name", "kind", "count"]
    assert list(obj["dynamic_batching"])[:3] == [
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "preserve_ordering",
    ]
    policy = json.dumps(
        obj["dynamic_batching"]["priority_queue_policy"]["1"], separators=(",", ":")
    )
    assert policy == (
        '{"timeout_action":"REJECT","default_timeout_microseconds":50000,'
        '"allow_timeout_override":false,"max_queue_size":8}'
    )


def test_model_config_to_json_nested_int64(tmp_path):
    config, _ = load(write_model(tmp_path, "ensemble_model", DOC_EXAMPLES["ensemble_model"]))
    obj = model_config_to_json(config)
    assert [s["model_version"] for s in obj["ensemble_scheduling"]["step"]] == [-1, -1, -1]
    assert obj["ensemble_scheduling"]["step"][0]["input_map"] == {"RAW_IMAGE": "IMAGE"}
    assert obj["version_policy"] == {"latest": {"num_versions": 1}}

    config, _ = load(write_model(tmp_path, "implicit_state", DOC_EXAMPLES["implicit_state"]))
    state = model_config_to_json(config)["sequence_batching"]["state"][0]
    assert state["dims"] == [-1]
    assert state["initial_state"][0]["dims"] == [1]
    assert (
        model_config_to_json(config)["sequence_batching"]["max_sequence_idle_microseconds"]
        == 1_000_000
    )

    config, _ = load(write_model(tmp_path, "model_warmup", DOC_EXAMPLES["model_warmup"]))
    warmup = model_config_to_json(config)["model_warmup"][0]
    assert warmup["inputs"]["input0"]["dims"] == [16]


@pytest.mark.parametrize("name", sorted(DOC_EXAMPLES))
def test_json_round_trip(tmp_path, name):
    config, _ = load(write_model(tmp_path, name, DOC_EXAMPLES[name]))
    assert model_config_from_json(model_config_to_json(config)) == config


def test_model_config_from_json_errors():
    with pytest.raises(InvalidArgument, match="invalid model configuration: .*bogus"):
        model_config_from_json({"bogus": 1})
    with pytest.raises(InvalidArgument, match="invalid model configuration"):
        model_config_from_json({"input": [{"data_type": "TYPE_NOPE"}]})


# -- versions -------------------------------------------------------------------------


def test_list_versions_ignores_non_versions(tmp_path):
    model_dir = write_model(
        tmp_path,
        "m",
        None,
        versions=[3, 1, 10, 2],
        files=dict.fromkeys(
            ["0/x", "01/x", "-1/x", "v4/x", ".5/x", "__pycache__/x", "warmup/x", "7"], b""
        ),
    )
    assert list_versions(model_dir) == [1, 2, 3, 10]


def test_list_versions_of_missing_directory(tmp_path):
    with pytest.raises(Unavailable, match="model 'gone'"):
        list_versions(tmp_path / "gone")


def policy_config(policy: str) -> mc.ModelConfig:
    config = mc.ModelConfig(name="m")
    if policy:
        text_format.Parse(f"version_policy {{ {policy} }}", config)
    return config


@pytest.mark.parametrize(
    ("policy", "available", "expected"),
    [
        ("", [1, 2, 3], [3]),
        ("latest { num_versions: 1 }", [1, 10, 2], [10]),
        ("latest { num_versions: 2 }", [1, 2, 3], [2, 3]),
        ("latest { num_versions: 5 }", [1, 2], [1, 2]),
        ("all { }", [3, 1, 2], [1, 2, 3]),
        ("specific { versions: [ 1, 3 ] }", [1, 2, 3], [1, 3]),
        ("specific { versions: [ 1, 4 ] }", [1, 2, 3], [1]),
    ],
)
def test_select_versions(policy, available, expected):
    assert select_versions(policy_config(policy), available) == expected


def test_missing_specific_versions():
    config = policy_config("specific { versions: [ 4, 1, 5 ] }")
    assert missing_versions(config, [1, 2]) == [4, 5]
    assert missing_versions(policy_config("all { }"), []) == []


@pytest.mark.parametrize(
    ("policy", "available", "expected"),
    [
        ("", [], "model 'm' has no versions to load: no version directories found"),
        ("all { }", [], "no version directories found"),
        (
            "specific { versions: [ 4, 5 ] }",
            [1, 2],
            "specific versions [4, 5] have no version directory (found [1, 2])",
        ),
        ("latest { }", [1], "latest num_versions is 0"),
    ],
)
def test_select_versions_errors(policy, available, expected):
    with pytest.raises(InvalidArgument) as info:
        select_versions(policy_config(policy), available)
    assert expected in info.value.message


# -- repository -----------------------------------------------------------------------


def test_repository_paths_must_be_directories(tmp_path):
    # Triton: INTERNAL "failed to stat file" (core filesystem/implementations/local.h)
    with pytest.raises(InternalError, match="failed to stat file .*does not exist"):
        ModelRepository([tmp_path / "nope"])
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgument, match="is not a directory"):
        ModelRepository([tmp_path, tmp_path / "file"])
    with pytest.raises(InvalidArgument):
        ModelRepository([])


def test_scan_finds_models_and_reports_duplicates(tmp_path):
    repo_a, repo_b = tmp_path / "a", tmp_path / "b"
    write_model(repo_a, "simple", ONNX_IO)
    write_model(repo_a, "shared", None)
    write_model(repo_a, ".hidden", None)
    write_model(repo_a, "__pycache__", None)
    (repo_a / "README.md").write_text("not a model")
    write_model(repo_b, "shared", None)
    write_model(repo_b, "other", None)
    repository = ModelRepository([repo_a, str(repo_b)])

    scan = repository.scan()
    assert scan == {"simple": repo_a / "simple", "other": repo_b / "other"}
    assert list(scan) == ["other", "simple"]
    assert scan.duplicates == {"shared": [repo_a / "shared", repo_b / "shared"]}

    assert repository.find("simple") == repo_a / "simple"
    assert repository.find("other") == repo_b / "other"
    with pytest.raises(
        InvalidArgument, match="model 'shared' appears in multiple model repositories"
    ):
        repository.find("shared")
    for name in ("missing", ".hidden", "__pycache__", "../a/simple", "", "README.md"):
        with pytest.raises(NotFound, match="is not found in the model repository"):
            repository.find(name)
