"""``--backend-config=<backend>,<key>=<value>``: tritonserver's backend settings here.

Triton hands each backend the settings named for it (and those given without a
backend name) when the backend first loads. Here:

- ``python``: ``shm-default-byte-size``, ``shm-growth-byte-size``,
  ``stub-timeout-seconds`` (and trionserve's ``initialize-timeout-seconds``,
  ``execute-timeout-seconds``, ``stub-max-restarts``) become the defaults of
  every Python model; a model's own ``parameters`` override them. A bad value is
  an error naming the flag.
- ``default-max-batch-size`` (global or ``onnxruntime,``): the ``max_batch_size``
  auto-complete gives an ONNX model that can batch (4 by default, as Triton).
- Every other setting (onnxruntime's thread counts, tensorrt's plugins, keys of
  backends this server does not have) is
  accepted and reported in one log line each as having no effect, as a Triton
  backend ignores keys it does not read.

Each server's :class:`~trionserve.backends.manager.BackendManager` holds what it
was given and configures the backends it creates with it.
"""

from __future__ import annotations

# backend name ("" for settings given without one) -> key -> value
BackendConfig = dict[str, dict[str, str]]


def parse_backend_config(values: list[str]) -> BackendConfig:
    """Triton's format, ``<backend>,<key>=<value>`` or ``<key>=<value>``; a
    repeated key keeps its last value. Raises ValueError quoting the bad one."""
    config: BackendConfig = {}
    for text in values:
        comma = text.find(",")
        equals = text.find("=", comma + 1)
        # Triton's words (server src/command_line_parser.cc ParseBackendConfigOption).
        if comma == 0:
            raise ValueError(
                "No backend specified. --backend-config option format is "
                f"<backend name>,<setting>=<value> or <setting>=<value>. Got {text}"
            )
        backend = text[:comma] if comma > 0 else ""
        key, value = text[comma + 1 : equals], text[equals + 1 :]
        if equals < 0 or not key or not value:
            raise ValueError(
                f"--backend-config option format is '<backend name>,<setting>=<value>'. Got {text}"
            )
        config.setdefault(backend, {})[key] = value
    return config
