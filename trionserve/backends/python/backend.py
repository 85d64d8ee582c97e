"""The ``backend: "python"`` Backend: Triton Python models (``model.py``).

Auto-complete runs the model class's static ``auto_complete_config`` in a
short-lived stub; loading checks the model file and its parameters; each instance
is a stub process started (and ``initialize``-d) by :meth:`PythonModel.create_instance`,
or, for a model with ``EXECUTION_MODE`` ``in_process``, a thread of the server
(:mod:`.inprocess`), which also runs its auto-complete.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trionserve.backends.base import Backend, InstanceSpec, ModelContext
from trionserve.backends.python.control import ModelControl
from trionserve.backends.python.delivery import initialize_args
from trionserve.backends.python.inprocess import InProcessInstance
from trionserve.backends.python.instance import PythonInstance
from trionserve.backends.python.model_namespace import auto_complete_in_process
from trionserve.backends.python.process import StubProcess
from trionserve.backends.python.runtime import describe_exception
from trionserve.backends.python.settings import IN_PROCESS, StubSettings, settings_for
from trionserve.core.errors import InvalidArgument, TritonError, Unavailable
from trionserve.observability.custom_metrics import CustomMetrics

if TYPE_CHECKING:
    from trionserve._generated.model_config_pb2 import ModelConfig

MODEL_FILENAME = "model.py"
# Characters a stub's name may not contain (python_backend pb_utils.h INVALID_CHARS).
STUB_NAME_INVALID_CHARS = frozenset(";|&$`<>()[]{}\\\"'*?~#!")


def check_stub_name(name: str) -> None:
    """Refuse a stub named after a model or instance with shell metacharacters,
    as python_backend does before it starts one (stub_launcher.cc Launch,
    IsValidIdentifier)."""
    if not name or not STUB_NAME_INVALID_CHARS.isdisjoint(name):
        raise InvalidArgument("Invalid stub name: contains invalid characters")


def may_auto_complete(model_path: Path) -> bool:
    """False only when model.py plainly has no ``auto_complete_config``.

    That is: ``TritonPythonModel`` is a class with no bases and no decorators, and
    the name ``auto_complete_config`` appears nowhere in the file. Anything else
    (or a file that does not parse) is left to a stub to find out, so the check
    only saves a process start for the common model.
    """
    try:
        source = model_path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return True
    if "auto_complete_config" in source:
        return True
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TritonPythonModel":
            return bool(node.bases or node.keywords or node.decorator_list)
    return True


def _model_config_json(config: ModelConfig) -> str:
    from trionserve.repository.config import model_config_to_json

    return json.dumps(model_config_to_json(config))


class PythonBackend(Backend):
    """``backend: "python"``: each model version's own model.py. With
    ``model_file``, a Python-based backend: every model naming that backend runs
    the one ``<backend directory>/<name>/model.py`` (Triton's layout)."""

    name = "python"

    def __init__(self, model_file: Path | None = None) -> None:
        self.model_file = model_file
        # --backend-config=python,... as the server's BackendManager checked it.
        self._defaults: Mapping[str, str] = {}

    def configure(self, settings: Mapping[str, str]) -> None:
        self._defaults = dict(settings)

    def default_model_filename(self) -> str:
        return MODEL_FILENAME

    def auto_complete_source(self, version_dir: Path, filename: str) -> Path:
        return self.model_file or version_dir / filename

    def auto_complete_config(
        self, config: ModelConfig, model_path: Path, max_batch_size_set: bool
    ) -> None:
        """Let the model's ``auto_complete_config`` complete ``config`` in place."""
        from trionserve.repository.config import model_config_from_json

        if self.model_file is not None:
            model_path = self.model_file

        mode = StubSettings.from_config(config, self._defaults).execution_mode  # checks them
        if not may_auto_complete(model_path):
            return
        if mode == IN_PROCESS:
            try:
                answer = {
                    "config": auto_complete_in_process(
                        _model_config_json(config), model_path, config.name
                    )
                }
            except Exception as exc:
                raise Unavailable(
                    f"model '{config.name}': auto_complete_config failed: {describe_exception(exc)}"
                ) from None
        else:
            answer = self._auto_complete_in_stub(config, model_path)
        try:
            completed = model_config_from_json(json.loads(answer["config"]))
        except TritonError as exc:
            raise InvalidArgument(
                f"model '{config.name}': auto_complete_config returned an invalid "
                f"configuration: {exc.message}"
            ) from None
        config.CopyFrom(completed)

    def _auto_complete_in_stub(self, config: ModelConfig, model_path: Path) -> dict[str, Any]:
        check_stub_name(config.name)  # the auto-complete stub is named after the model
        settings = settings_for(config, model_path.parent.parent, self._defaults)
        # Whatever metric families auto_complete_config defines go when this stub
        # ends, before the model loads: a registry of its own that nothing exposes.
        stub = StubProcess(
            f"model '{config.name}'", settings, name=config.name, metrics=CustomMetrics()
        )
        try:
            answer = stub.request(
                {
                    "op": "auto_complete",
                    "model_file": str(model_path),
                    "model_name": config.name,
                    "config": _model_config_json(config),
                },
                "auto_completed",
                settings.stub_timeout,
                "auto_complete_config",
            )
        finally:
            stub.stop(finalize=False)
        return answer

    def load(self, context: ModelContext) -> PythonModel:
        if self.model_file is not None:
            return PythonModel(
                context,
                self.model_file,
                settings_for(context.config, context.model_dir, self._defaults),
            )
        filename = context.config.default_model_filename or MODEL_FILENAME
        path = context.version_dir / filename
        if not path.is_file():
            raise Unavailable(
                f"model file '{filename}' not found in version {context.version} of "
                f"model '{context.name}' ({context.version_dir.name}/)"
            )
        return PythonModel(
            context, path, settings_for(context.config, context.model_dir, self._defaults)
        )


class PythonModel:
    """A loaded Python model: the file, its settings and the config JSON it is given."""

    def __init__(self, context: ModelContext, path: Path, settings: StubSettings) -> None:
        self.context = context
        self.path = path
        self.settings = settings
        self._config_json = _model_config_json(context.config)

    def start_stub(self, spec: InstanceSpec) -> StubProcess:
        """Start a stub for ``spec`` and run the model's ``initialize`` (blocking)."""
        context = self.context
        check_stub_name(spec.name)
        label = f"model '{context.name}' instance '{spec.name}'"
        control = ModelControl(context.inference, context.name)
        stub = StubProcess(label, self.settings, control, spec.name, metrics=context.metrics)
        args = initialize_args(context, spec, self._config_json)
        try:
            answer = stub.request(
                {
                    "op": "initialize",
                    "args": args,
                    "model_file": str(self.path),
                    "model_dir": str(context.version_dir),
                    "model_name": context.name,
                    "instance": spec.name,
                    "decoupled": context.config.model_transaction_policy.decoupled,
                },
                "initialized",
                self.settings.initialize_timeout,
                "initialize",
            )
        except BaseException:
            stub.stop(finalize=False)
            raise
        stub.has_is_ready = answer.get("is_ready", False)
        return stub

    def create_instance(self, spec: InstanceSpec) -> PythonInstance | InProcessInstance:
        if self.settings.execution_mode == IN_PROCESS:
            return InProcessInstance(
                self.context, spec, self.settings, self.path, self._config_json
            )
        stub = self.start_stub(spec)
        return PythonInstance(
            self.context, spec, self.settings, lambda: self.start_stub(spec), stub
        )

    def unload(self) -> None:
        pass
