"""Models in the in-process API: versions as Triton numbers them, ``load``'s
override arguments, and ``models()``'s dictionary."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from trionserve.api._errors import InvalidArgumentError


def route_version(version: int) -> int | None:
    """Triton's -1 ("the version policy decides") as the registry's None."""
    if version == -1:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidArgumentError(
            f"model version must be -1 or a positive integer, got {version!r}"
        )
    return version


def load_arguments(
    parameters: dict[str, Any] | None, config: str | dict | None, files: dict[str, bytes] | None
) -> tuple[str | None, dict[str, bytes]]:
    """``load``'s override: Triton's ``parameters`` ({"config": JSON, "file:<path>":
    bytes}), or the ``config`` and ``files`` keywords."""
    parameters = dict(parameters or {})
    if config is not None:
        parameters["config"] = config
    for path, content in (files or {}).items():
        key = path if path.startswith("file:") else f"file:{path}"
        parameters[key] = content
    config_text = parameters.pop("config", None)
    if isinstance(config_text, dict):
        config_text = json.dumps(config_text)
    elif config_text is not None and not isinstance(config_text, str):
        raise InvalidArgumentError("load parameter 'config' must be a JSON string or a dict")
    contents: dict[str, bytes] = {}
    for key, value in parameters.items():
        if not key.startswith("file:"):
            raise InvalidArgumentError(
                f"unknown load parameter '{key}': expected 'config' or 'file:<version>/<name>'"
            )
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"load parameter '{key}' must be bytes")
        contents[key] = bytes(value)
    return config_text, contents


_M = TypeVar("_M")


class ModelDictionary(dict[tuple[str, int], _M]):
    """``models()``: (name, version) -> Model, as Triton's ModelDictionary; a bare
    name gives the model at version -1."""

    def __init__(
        self,
        make_model: Callable[[str, int, str | None, str | None], _M],
        rows: list[dict[str, Any]],
    ) -> None:
        super().__init__()
        self._make_model = make_model
        for row in rows:
            version = row.get("version", "")
            number = int(version) if str(version).isdigit() else -1
            model = make_model(row["name"], number, row.get("state"), row.get("reason"))
            self[(row["name"], number)] = model
        self._names = {name for name, _ in self}

    def __getitem__(self, key: tuple[str, int] | str) -> _M:
        if isinstance(key, tuple):
            try:
                return dict.__getitem__(self, key)
            except KeyError:
                raise KeyError(f"Unknown Model: {key}") from None
        if key in self._names:
            return self._make_model(key, -1, None, None)
        raise KeyError(f"Unknown Model: {key}")


def describe_model(name: str, version: int, state: str | None) -> str:
    return repr({"name": name, "version": version, "state": state})
