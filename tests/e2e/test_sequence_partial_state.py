"""A Python model's implicit state it did not write keeps its value (real server,
real tritonclient)."""

from __future__ import annotations

import numpy as np
import tritonclient.http as httpclient

from tests.e2e.test_sequence_e2e import STATE, TENSORS, ZERO
from tests.serverproc import ServerProcess

# A Python model with an implicit state that writes OUTPUT_STATE only for a positive
# INPUT: the state it did not write keeps its value, as in Triton, where a state
# changes only when the backend updates it (core sequence_state.cc, the update
# callback of SequenceStates::OutputState); qa/L0_sequence_batcher serves such
# models (its Python accumulator never writes its state).
PARTIAL_STATE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "INPUT_STATE").as_numpy()
            total = (value + state).astype(np.int32)
            outputs = [pb_utils.Tensor("OUTPUT", total)]
            if value.item() > 0:
                outputs.append(pb_utils.Tensor("OUTPUT_STATE", total))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""


def test_a_state_the_model_did_not_write_keeps_its_value(tmp_path):
    (tmp_path / "partial" / "1").mkdir(parents=True)
    (tmp_path / "partial" / "1" / "model.py").write_text(PARTIAL_STATE_MODEL)
    (tmp_path / "partial" / "config.pbtxt").write_text(
        'name: "partial"\nbackend: "python"\nmax_batch_size: 1\n'
        f"{TENSORS % ''}\nsequence_batching {{\ndirect {{ }}\n{STATE % ZERO}\n}}\n"
    )
    proc = ServerProcess(tmp_path)
    try:
        proc.wait_ready(path="/v2/health/ready")
        client = httpclient.InferenceServerClient(proc.http_url, network_timeout=20)

        def add(value: int, **flags) -> int:
            infer_input = httpclient.InferInput("INPUT", [1, 1], "INT32")
            infer_input.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            result = client.infer("partial", [infer_input], sequence_id=7, **flags)
            return int(result.as_numpy("OUTPUT")[0, 0])

        assert add(-1, sequence_start=True) == -1  # not written: stays the initial 0
        assert add(5) == 5  # written: 5
        assert add(-2) == 3  # not written: stays 5
        assert add(1) == 6
        assert add(0, sequence_end=True) == 6
        assert add(4, sequence_start=True, sequence_end=True) == 4  # START: initial again
        client.close()
        assert proc.stop() == 0, proc.output()
    finally:
        proc.close()
