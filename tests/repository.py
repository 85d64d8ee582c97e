"""Model repositories written by tests: a model's directory, its ``config.pbtxt``
and the files of its versions, laid out as Triton reads them
(``<repository>/<model>/config.pbtxt``, ``<repository>/<model>/<version>/...``)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

from tests.fake_backend import MODEL_FILE


def write_model(
    repository: Path,
    name: str,
    config: str | None,
    files: Mapping[str, str | bytes] | None = None,
    versions: Iterable[int] = (),
) -> Path:
    """Model ``name`` in ``repository``, returned as its directory: ``config.pbtxt``
    holding ``config`` as given (no file when None), an empty directory for each of
    ``versions``, and each of ``files`` ({path under the model's directory, such as
    ``"1/model.py"``: its text or bytes})."""
    model = repository / name
    model.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (model / "config.pbtxt").write_text(config)
    for version in versions:
        (model / str(version)).mkdir(exist_ok=True)
    for relative, content in (files or {}).items():
        path = model / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return model


def python_model(
    repository: Path,
    name: str,
    config: str,
    source: str,
    files: Mapping[str, str | bytes] | None = None,
) -> Path:
    """A Python backend model: ``config.pbtxt`` and version 1's ``model.py`` from
    ``source`` (both dedented), with any more ``files`` as for :func:`write_model`."""
    files = {"1/model.py": textwrap.dedent(source), **(files or {})}
    return write_model(repository, name, textwrap.dedent(config), files)


def echo_model(
    repository: Path, name: str, backend: str, config: str = "", dims: str = "-1"
) -> Path:
    """A model of an in-process test backend (``tests/fake_backend.py``) that
    answers FP32 ``INPUT0`` with ``OUTPUT0``: batches of up to 8, tensors of
    ``dims``, ``config`` appended to its configuration, and the backend's model file
    in version 1."""
    return write_model(
        repository,
        name,
        f'name: "{name}"\nbackend: "{backend}"\nmax_batch_size: 8\n'
        f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]\n'
        f"{config}\n",
        {f"1/{MODEL_FILE}": "test model\n"},
    )
