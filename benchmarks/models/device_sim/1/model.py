"""A device as a Python-backend model: each batch takes ``BASE_SECONDS`` +
``PER_ITEM_SECONDS`` x its items (4 ms + 0.25 ms, a GPU forward's order of
magnitude), slept with the GIL released as a device's wait is; every request
gets its INPUT0 back as OUTPUT0. The model of benchmarks.device_sim, served
unchanged by trionserve and by Triton."""

import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})

        def seconds(key, default):
            return float(parameters.get(key, {}).get("string_value", default))

        self.base = seconds("BASE_SECONDS", "0.004")
        self.per_item = seconds("PER_ITEM_SECONDS", "0.00025")
        # Answer only the input's first elements (a large input, a small answer: a
        # classifier's); 0: the whole input.
        self.answered = int(seconds("OUTPUT_ELEMENTS", "0"))

    def execute(self, requests):
        inputs = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        items = sum(len(data) for data in inputs)
        time.sleep(self.base + self.per_item * items)
        if self.answered:
            inputs = [data[:, : self.answered].copy() for data in inputs]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]) for data in inputs]
