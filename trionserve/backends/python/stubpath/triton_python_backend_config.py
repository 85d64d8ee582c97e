"""The model configuration as ``triton_python_backend_utils`` gives it to a model.

``ModelConfig``, the configuration a model's ``auto_complete_config`` may complete
(python_backend's ``ModelConfig`` in ``triton_python_backend_utils.py``), and the
helpers that read a configuration dictionary (``get_input_config_by_name``,
``get_output_config_by_name``, ``using_decoupled_model_transaction_policy``). Part
of the module model.py imports as ``triton_python_backend_utils``, which re-exports
these names; it holds no runtime and no state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# A configuration, or a part of one, as JSON (model_config_to_json's shape).
ConfigJson = dict[str, Any]


def get_input_config_by_name(model_config: ConfigJson, name: str) -> ConfigJson | None:
    for entry in model_config.get("input", []):
        if entry["name"] == name:
            return entry
    return None


def get_output_config_by_name(model_config: ConfigJson, name: str) -> ConfigJson | None:
    for entry in model_config.get("output", []):
        if entry["name"] == name:
            return entry
    return None


def using_decoupled_model_transaction_policy(model_config: ConfigJson) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class ModelConfig:
    """The configuration ``auto_complete_config`` may complete.

    Only max_batch_size, inputs, outputs, dynamic batching and the transaction
    policy can be set; a value that contradicts config.pbtxt raises ValueError.
    """

    _INPUT_PROPERTIES = ("name", "data_type", "dims", "optional")
    _OUTPUT_PROPERTIES = ("name", "data_type", "dims")

    def __init__(self, model_config: str) -> None:
        self._model_config: ConfigJson = json.loads(model_config)
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self) -> ConfigJson:
        return self._model_config

    @property
    def _name(self) -> str:
        return self._model_config.get("name", "")

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = self._model_config.get("max_batch_size", 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in "
                f"auto-complete-config function for model '{self._name}' specified "
                f"max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if self._model_config.get(other):
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name}' tries to "
                    "set scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        self._add("input", input, self._INPUT_PROPERTIES)

    def add_output(self, output: Mapping[str, Any]) -> None:
        self._add("output", output, self._OUTPUT_PROPERTIES)

    def _add(self, kind: str, tensor: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        # python_backend src/resources/triton_python_backend_utils.py ModelConfig
        # add_input / add_output (lines 389-413, 488-512): its words, its order.
        label = f"{kind} '{tensor.get('name', '')}'"
        where = f"in auto-complete-config function for model '{self._name}'"
        if any(key not in allowed for key in tensor):
            quoted = [f"'{a}'" for a in allowed]
            raise ValueError(
                f"{label} {where} contains property other than "
                f"{', '.join(quoted[:-1])} and {quoted[-1]}."
            )
        if "name" not in tensor:
            raise ValueError(f"{kind} {where} is missing 'name' property.")
        for key in allowed[1:3]:
            if key not in tensor:
                raise ValueError(f"{label} {where} is missing '{key}' property.")
        for current in self._model_config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            current_type = current.get("data_type", "TYPE_INVALID")
            if current_type not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(
                    f"unable to load model '{self._name}', configuration expects "
                    f"datatype {current_type} for {kind} '{tensor['name']}', model "
                    f"provides {tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model "
                    f"expects dims {list(tensor['dims'])} but the model configuration "
                    f"specifies dims {list(current['dims'])}"
                )
            if (
                "optional" in tensor
                and "optional" in current
                and bool(current["optional"]) != bool(tensor["optional"])
            ):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model "
                    f"expects optional {tensor['optional']} but the model "
                    f"configuration specifies optional {current['optional']}"
                )
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        extra = [key for key in transaction_policy_dict if key != "decoupled"]
        if extra:
            raise ValueError(
                "model transaction property in auto-complete-config function for model "
                f"'{self._name}' contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config for "
                    f"model '{self._name}', which is already set to "
                    f"'{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted
