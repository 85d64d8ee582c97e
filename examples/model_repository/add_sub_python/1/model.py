"""add_sub: OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1, as a Triton
Python model (the same model.py runs unchanged on Triton's Python backend)."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        output0 = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1 = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out_0 = pb_utils.Tensor("OUTPUT0", (in_0 + in_1).astype(self.output0_dtype))
            out_1 = pb_utils.Tensor("OUTPUT1", (in_0 - in_1).astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1]))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("add_sub_python: finalized")
