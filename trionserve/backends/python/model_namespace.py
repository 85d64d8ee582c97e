"""One in-process instance's import of ``model.py``, with pb_utils modules of its own.

An in-process model (:mod:`.inprocess`) runs in the server's interpreter, where
Triton's python_backend gives each model instance a stub process and so a module
namespace of its own. :class:`ModelNamespace` keeps that isolation in one
process: each instance loads its own ``triton_python_backend_utils`` and
``c_python_backend_utils`` (the stub's modules, from ``stubpath/``) and imports
``model.py`` as ``<package>.model`` (Triton imports ``<version>.model``), and a
late ``import triton_python_backend_utils`` inside a function gets the module of
the model whose thread runs it. Also here: the model class's
``auto_complete_config`` run in the server (:func:`auto_complete_in_process`).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import threading
import types
from pathlib import Path
from typing import Any

from trionserve.backends.python.stub import STUBPATH

PB_MODULE = "triton_python_backend_utils"
C_MODULE = "c_python_backend_utils"
# The modules PB_MODULE imports its names from (stubpath/), in the order they import
# each other: loaded anew with it for each instance, so no two models share them.
PB_SIBLINGS = (
    "triton_python_backend_errors",
    "triton_python_backend_dtypes",
    "triton_python_backend_tensor",
    "triton_python_backend_config",
)

# Model imports change sys.modules and sys.path for a moment: one at a time.
_IMPORT_LOCK = threading.Lock()
_PACKAGES = itertools.count(1)
# The pb_utils modules (by name) of the model whose code runs on this thread.
_bound = threading.local()


class _LateImport(types.ModuleType):
    """``sys.modules['triton_python_backend_utils']`` outside model imports: an
    ``import`` inside a function gets the module of the model whose thread runs it."""

    def __getattr__(self, name: str) -> Any:
        module = getattr(_bound, "modules", {}).get(self.__name__)
        if module is None:
            raise AttributeError(
                f"{self.__name__}.{name}: this thread runs no in-process model; import "
                f"{self.__name__} at the top of model.py, where every model gets its own"
            )
        return getattr(module, name)


def _module_from_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ModelNamespace:
    """One instance's import of model.py, with its own pb_utils modules.

    model.py is imported as ``<package>.model``, the package being a fresh one
    whose directory is the version directory (Triton imports ``<version>.model``),
    so relative imports work and two models' ``1.model`` never meet. While it is
    imported, ``triton_python_backend_utils``, ``c_python_backend_utils`` and the
    former's sibling modules in ``sys.modules`` are this instance's, and the
    version and model directories are on ``sys.path`` (as a stub puts them);
    afterwards the modules imported from those directories are taken out of
    ``sys.modules`` again, so another model's ``import utils`` finds its own.
    """

    def __init__(self, model_file: Path, runtime: Any) -> None:
        version_dir = model_file.parent
        self.package = f"_trionserve_model_{next(_PACKAGES)}"
        with _IMPORT_LOCK:
            saved = {name: sys.modules.get(name) for name in (PB_MODULE, C_MODULE)}
            saved_siblings = {name: sys.modules.get(name) for name in PB_SIBLINGS}
            path = list(sys.path)
            before = set(sys.modules)
            try:
                for name in PB_SIBLINGS:
                    sys.modules[name] = _module_from_file(name, STUBPATH / f"{name}.py")
                self.pb = _module_from_file(PB_MODULE, STUBPATH / f"{PB_MODULE}.py")
                setattr(self.pb, "_runtime", runtime)  # noqa: B010 - the module's hook
                sys.modules[PB_MODULE] = self.pb
                self.c_pb = _module_from_file(C_MODULE, STUBPATH / f"{C_MODULE}.py")
                sys.modules[C_MODULE] = self.c_pb
                package = types.ModuleType(self.package)
                package.__path__ = [str(version_dir)]
                sys.modules[self.package] = package
                sys.path.extend([str(version_dir), str(version_dir.parent)])
                self.module = importlib.import_module(f"{self.package}.{model_file.stem}")
            except BaseException:
                self.close()
                raise
            finally:
                sys.path[:] = path
                for name, module in saved.items():
                    sys.modules[name] = module if module is not None else _LateImport(name)
                for name, module in saved_siblings.items():
                    if module is None:
                        sys.modules.pop(name, None)
                    else:
                        sys.modules[name] = module
                self._forget_local_modules(before, version_dir.parent)

    def _forget_local_modules(self, before: set[str], model_dir: Path) -> None:
        """Take out of sys.modules what was imported from the model's directory
        under a plain name (its helpers): the model keeps them, others do not see
        them."""
        root = model_dir.resolve()
        for name in set(sys.modules) - before:
            if name == self.package or name.startswith(self.package + "."):
                continue
            origin = getattr(sys.modules[name], "__file__", None)
            if origin and Path(origin).resolve().is_relative_to(root):
                del sys.modules[name]

    def bind(self) -> None:
        """Late imports of the pb_utils modules on this thread get this model's."""
        _bound.modules = {PB_MODULE: self.pb, C_MODULE: self.c_pb}

    def close(self) -> None:
        """Forget the model's package (its module stays with whoever holds it)."""
        for name in [
            n for n in sys.modules if n == self.package or n.startswith(self.package + ".")
        ]:
            sys.modules.pop(name, None)


def auto_complete_in_process(config_json: str, model_file: Path, model_name: str) -> str:
    """The model class's ``auto_complete_config`` run in the server: the completed
    configuration as JSON (a stub's auto-complete, without the stub)."""
    namespace = ModelNamespace(model_file, None)
    try:
        pb = namespace.pb
        config = pb.ModelConfig(config_json)
        model_class = namespace.module.TritonPythonModel
        if hasattr(model_class, "auto_complete_config"):
            config = model_class.auto_complete_config(config)
            if not isinstance(config, pb.ModelConfig):
                raise TypeError(
                    f"auto_complete_config function in model '{model_name}' "
                    "must return a valid pb.ModelConfig object."
                )
        return json.dumps(config.as_dict())
    finally:
        namespace.close()


def unbind() -> None:
    """Late imports of the pb_utils modules on this thread get no model's any more."""
    _bound.modules = {}
