"""SageMaker's multi-model endpoint (MME) on the SageMaker port: load a model from
a directory named in the request, list, describe, invoke and unload it, as
Triton's SagemakerAPIServer does (server src/sagemaker_server.cc:185-266 routes,
:297-363 ParseSageMakerRequest, :431-624 SageMakerMMEHandleInfer, :696-806
SageMakerMMEUnloadModel, :808-883 get and list, :885-943 the out-of-memory check,
:946-1145 SageMakerMMELoadModel).

- ``POST /models`` ``{"model_name": <name>, "url": <dir>}``: registers the
  directory as a model repository with a name mapping (Triton's
  ``TRITONSERVER_ServerRegisterModelRepository``: ``ModelRepository.register``)
  and loads the model by the name ``X-Amzn-SageMaker-Target-Model`` gives (else
  ``model_name``). A ``url`` holding ``config.pbtxt`` is the model itself: its
  parent is registered, the url's directory mapped (for a
  ``<hash>/model/<subdir>`` url, Triton registers ``<hash>`` and maps ``model``,
  :1046-1073, a directory without the config: here ``<subdir>`` is the model, as
  the url says). Otherwise the url is a
  repository of several models: its ensemble (a subdirectory whose config.pbtxt
  says ``platform: "ensemble"``) is mapped, else its (last) subdirectory; the
  others load as the ensemble's steps. 200 with no body; 409 when the
  repository or the name is registered already (or ``model_name`` is listed);
  507 when the load failed for memory (Triton's list of messages); else 400 with
  the error; the registration is undone on failure.
- ``GET /models``: ``{"models": [{"modelName", "modelUrl"}, ...]}``, the url
  being the registered repository as the request named it; ``{}`` in place of
  a model that is not ready (as Triton's list). ``GET /models/<name>``: one,
  404 with no body when not loaded.
- ``POST /models/<name>/invoke``: 404 with no body unless loaded, then the
  ``/invocations`` request on the target model (the header, else ``<name>``);
  its errors 400, or 507 for memory (SageMakerMMEHandleOOMError).
- ``DELETE /models/<name>``: 404 unless loaded; unloads the target model and
  the models loaded only as its steps, then unregisters its repository; 200.

Served, as Triton's binary serves these routes, whenever ``--allow-sagemaker`` is
on (the environment's ``SAGEMAKER_MULTI_MODEL``, which Triton's
docker/sagemaker/serve script reads to pick EXPLICIT mode, is not consulted by
the binary, nor here). Triton confines ``url`` by its shape
(``/opt/ml/models/<hash>/model[/<subdir>]``, sagemaker_server.cc:86-87,
:1047-1058, after refusing ``/dev/``, ``/proc/``, ``/sys/``); here, more strictly,
so that a request never makes the server read a directory the operator did not
give it: ``url`` must have that shape under ``--sagemaker-multi-model-root``
(default ``/opt/ml/models``, where SageMaker puts a multi-model endpoint's
models; an empty root turns the endpoint off, every route answering 404 naming
why), must not contain ``..``, and neither it nor any symbolic link inside the
registered directory may resolve outside the root (the root itself may be a
link). The model control mode must be EXPLICIT, as Triton's core requires for a
registration (model_repository_manager.cc:1721-1726).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import structlog
import trio

from trionserve.actors.watcher import ControlMode
from trionserve.core.errors import AlreadyExists, InvalidArgument, TritonError
from trionserve.dataplane import DataPlane
from trionserve.protocol.http.frontend import _header, _json
from trionserve.protocol.http.transport import Handler, Headers, RequestBody, Response
from trionserve.protocol.restricted import RestrictedCategory
from trionserve.repository.repository import check_model_name

log = structlog.get_logger(__name__)

TARGET_MODEL = b"x-amzn-sagemaker-target-model"
DEFAULT_ROOT = "/opt/ml/models"
# sagemaker_server.cc:86-88: the url's parts, and an ensemble's config.
_PART = re.compile(r"[0-9A-Za-z._]+")
_ENSEMBLE = re.compile(r'platform:(\s)*"ensemble"')
_CONFIG_READ_LIMIT = 1 << 20
# sagemaker_server.cc:894-911, SageMakerMMECheckOOMError.
OUT_OF_MEMORY = (
    "CUDA out of memory",
    "CUDA_OUT_OF_MEMORY",
    "Out of memory",
    "Out Of Memory",
    "out of memory",
    "MemoryError",
    "OutOfMemory",
    "OOM",
    "Dst tensor is not initialized",
    "Src tensor is not initialized",
    "CNMEM_STATUS_OUT_OF_MEMORY",
    "CUDNN_STATUS_NOT_INITIALIZED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_NOT_INITIALIZED",
    "Failed to allocate memory",
    "failed to allocate memory",
    "No space left on device",
)
_NOT_FOUND: Response = (404, [(b"content-length", b"0")], ())
_OK: Response = (200, [(b"content-length", b"0")], ())


def out_of_memory(message: str) -> bool:
    """Whether an error says memory ran out, as Triton's SageMaker server reads it."""
    return any(text in message for text in OUT_OF_MEMORY)


@dataclass(frozen=True)
class Placement:
    """Where a model of the endpoint lives: the repository registered (its links
    resolved), the subdirectory mapped to the model's name, and the repository
    as the request named it (the answers' ``modelUrl``)."""

    repository: Path
    subdir: str
    url: str


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def place_model(root: str, url: str) -> Placement:
    """The repository and mapped subdirectory a load's ``url`` names, confined to
    ``root``; InvalidArgument naming why not, a directory the server cannot read
    included (Triton's registration fails as a 400 too). Blocking (it reads the
    disk)."""
    try:
        return _place_model(root, url)
    except OSError as exc:
        raise InvalidArgument(f"\"url\" '{url}' cannot be read: {exc}") from None


def _place_model(root: str, url: str) -> Placement:
    if "\0" in url:
        raise InvalidArgument('"url" must not contain NUL')
    if ".." in url.split("/"):
        raise InvalidArgument(f"\"url\" '{url}' must not contain '..'")
    absolute = os.path.abspath(url)  # lexically normal, as Triton's (:326-330)
    if any(_inside(absolute, system) for system in ("/dev", "/proc", "/sys")):
        raise InvalidArgument(
            f'Invalid URL: {url}. "url" property value cannot start with /dev/, /proc/, or /sys/.'
        )
    root = os.path.abspath(root)
    parts = os.path.relpath(absolute, root).split("/") if _inside(absolute, root) else []
    if not (2 <= len(parts) <= 3 and parts[1] == "model" and all(map(_PART.fullmatch, parts))):
        raise InvalidArgument(
            f"Invalid \"url\" '{url}': expected a path of the form "
            f"{root}/<hash>/model[/<subdir>] (--sagemaker-multi-model-root)"
        )
    real_root = os.path.realpath(root)
    real = os.path.realpath(absolute)
    if not _inside(real, real_root):
        raise InvalidArgument(
            f"\"url\" '{url}' resolves to '{real}', outside the multi-model root '{root}'"
        )
    if not os.path.isdir(real):
        raise InvalidArgument(f"failed to register '{absolute}', repository not found")
    if os.path.isfile(os.path.join(real, "config.pbtxt")):
        repository, subdir = os.path.split(real)
        model_url = os.path.dirname(absolute)
    else:
        repository, subdir, model_url = real, "", absolute
    if repository == real_root:  # (a link to a directory just under the root)
        raise InvalidArgument(
            f"\"url\" '{url}' resolves to '{real}': its repository would be the "
            f"multi-model root '{root}' itself"
        )
    _check_links(repository, real_root, url)  # before any config is read
    return Placement(Path(repository), subdir or _model_subdir(real, url), model_url)


def _model_subdir(repository: str, url: str) -> str:
    """A repository's ensemble, else its last subdirectory (sagemaker_server.cc:971-1035
    takes the last in directory order; here, by name)."""
    with os.scandir(repository) as entries:
        subdirs = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    if not subdirs:
        raise InvalidArgument(f"\"url\" '{url}' holds no model directory")
    ensembles = [name for name in subdirs if _is_ensemble(os.path.join(repository, name))]
    return (ensembles or subdirs)[-1]


def _is_ensemble(model_dir: str) -> bool:
    try:
        with open(os.path.join(model_dir, "config.pbtxt"), encoding="utf-8", errors="replace") as f:
            return _ENSEMBLE.search(f.read(_CONFIG_READ_LIMIT)) is not None
    except OSError:
        return False


def _check_links(repository: str, real_root: str, url: str) -> None:
    """Refuse a registered directory with a symbolic link that leads out of the root."""
    for where, dirs, files in os.walk(repository):
        for name in (*dirs, *files):
            path = os.path.join(where, name)
            if os.path.islink(path) and not _inside(os.path.realpath(path), real_root):
                raise InvalidArgument(
                    f"\"url\" '{url}': '{path}' is a symbolic link to "
                    f"'{os.path.realpath(path)}', outside the multi-model root"
                )


@dataclass
class _Loaded:
    url: str
    repository: Path


class MultiModelEndpoint:
    """The models loaded through the endpoint (Triton's ``sagemaker_models_list_``:
    model name -> repository) and the route handlers. Runs on the Trio thread:
    the table changes only between awaits, so a check and its change are one step.

    ``infer(target, headers, body)`` is the SageMaker port's ``/invocations``
    request on another model; ``checked`` puts a restricted group's header check
    in front of a handler (``--http-restricted-api``).
    """

    def __init__(
        self,
        dataplane: DataPlane,
        root: str,
        infer: Callable[[str, Headers, RequestBody], Awaitable[Response]],
        checked: Callable[[RestrictedCategory, Handler], Handler],
    ) -> None:
        self.dataplane = dataplane
        self.root = root
        self._infer = infer
        self._checked = checked
        self.models: dict[str, _Loaded] = {}
        self._loading: set[str] = set()

    def route(self, method: bytes, name: str, invoke: bool) -> Handler:
        """The handler of ``/models[/<name>][/invoke]`` for GET, POST or DELETE,
        in Triton's order: POST with ``/invoke`` is an invoke (checked against
        the loaded list, then the inference restriction); any other POST a load;
        GET a list or a get, DELETE an unload (the model-repository restriction)."""
        if method == b"POST" and invoke:
            return partial(self.invoke, name)
        if method == b"GET":
            handler: Handler = partial(self.get, name) if name else self.list
        elif method == b"POST":
            handler = self.load
        else:
            handler = partial(self.unload, name)
        return self._checked(RestrictedCategory.MODEL_REPOSITORY, handler)

    async def list(self, headers: Headers, body: RequestBody) -> Response:
        models: list[dict[str, str]] = []
        for name, loaded in list(self.models.items()):
            ready = await self.dataplane.model_is_ready(name, 1)  # (:857, version 1)
            models.append({"modelName": name, "modelUrl": loaded.url} if ready else {})
        return _json({"models": models})

    async def get(self, name: str, headers: Headers, body: RequestBody) -> Response:
        loaded = self.models.get(name)
        if loaded is None:
            return _NOT_FOUND
        return _json({"modelName": name, "modelUrl": loaded.url})

    async def invoke(self, name: str, headers: Headers, body: RequestBody) -> Response:
        if name not in self.models:
            return _NOT_FOUND
        target = _header(headers, TARGET_MODEL) or name
        log.info("Invoking SageMaker TargetModel: " + target)
        handler = self._checked(RestrictedCategory.INFERENCE, partial(self._infer, target))
        status, response_headers, chunks = await handler(headers, body)
        if status in (200, 403, 503) or not isinstance(chunks, (list, tuple)):
            return status, response_headers, chunks  # 503: draining; a stream: an answer
        # sagemaker_server.cc:409-420, :927-943: every error 400, or 507 for memory.
        error = b"".join(bytes(c) for c in chunks)
        status = 507 if out_of_memory(error.decode("utf-8", "replace")) else 400
        return status, response_headers, [error]

    async def load(self, headers: Headers, body: RequestBody) -> Response:
        try:
            model_name, url = _load_request(body)
            target = _header(headers, TARGET_MODEL) or model_name
            check_model_name(target)
        except TritonError as error:
            return _json({"error": error.message}, 400)
        log.info("Loading SageMaker TargetModel: " + target)  # (:360)
        if model_name in self.models or model_name in self._loading:
            return _json({"error": f"model '{model_name}' is already loaded"}, 409)
        if self.dataplane.control_mode is not ControlMode.EXPLICIT:
            return _json(
                {
                    "error": "repository registration is not allowed if model control "
                    "mode is not EXPLICIT"
                },
                400,
            )
        repository = self.dataplane.registry.repository
        self._loading.add(model_name)
        try:
            try:
                placement = await trio.to_thread.run_sync(place_model, self.root, url)
                repository.register(placement.repository, {target: placement.subdir})
            except AlreadyExists as error:
                return _json({"error": error.message}, 409)
            except TritonError as error:
                return _json({"error": error.message}, 400)
            loaded = False
            try:
                await self.dataplane.registry.load(target, reason="SageMaker load")
                loaded = True
            except TritonError as error:
                status = 409 if isinstance(error, AlreadyExists) else 400
                if out_of_memory(error.message):
                    status = 507
                return _json({"error": error.message}, status)
            finally:
                if not loaded:  # failed or cancelled (:1129-1136)
                    repository.unregister(placement.repository)
            self.models[model_name] = _Loaded(placement.url, placement.repository)
            return _OK
        finally:
            self._loading.discard(model_name)

    async def unload(self, name: str, headers: Headers, body: RequestBody) -> Response:
        loaded = self.models.pop(name, None)
        if loaded is None:
            return _NOT_FOUND
        target = _header(headers, TARGET_MODEL) or name
        log.info("Unloading SageMaker TargetModel: " + target)
        # Shielded: once begun, the unload and the unregistration finish together.
        with trio.CancelScope(shield=True):
            try:
                await self.dataplane.registry.unload(
                    target, unload_dependents=True, reason="SageMaker unload"
                )
            except TritonError as error:
                self.models[name] = loaded
                return _json({"error": error.message}, 400)
            try:
                self.dataplane.registry.repository.unregister(loaded.repository)
            except TritonError as error:
                return _json({"error": error.message}, 400)
        return _OK


# Python's json errors in RapidJSON's words (its GetParseError_En), which Triton's
# EVRequestToJson reports: "failed to parse the request JSON buffer: <text> at <offset>".
_RAPIDJSON_ERRORS = (
    ("Expecting value", "Invalid value."),
    ("Extra data", "The document root must not be followed by other values."),
    ("Expecting property name", "Missing a name for object member."),
    ("Expecting ':' delimiter", "Missing a colon after a name of object member."),
    ("Expecting ',' delimiter", "Missing a comma or '}' after an object member."),
    ("Unterminated string", "Missing a closing quotation mark in string."),
    ("Invalid control character", "Invalid encoding in string."),
    ("Invalid \\escape", "Invalid escape character in string."),
)


def parse_json(body: RequestBody) -> object:
    """A load's JSON body, or InvalidArgument in Triton's words (http_server.cc
    EVRequestToJson, with RapidJSON's messages where Python's parser has a match)."""
    data = bytes(body)
    if not data.strip():
        raise InvalidArgument(
            "failed to parse the request JSON buffer: The document is empty. at 0"
        )
    try:
        return json.loads(data)
    except RecursionError:
        raise InvalidArgument("failed to parse the request JSON: nested too deeply") from None
    except json.JSONDecodeError as exc:
        text = next(
            (words for start, words in _RAPIDJSON_ERRORS if exc.msg.startswith(start)), exc.msg
        )
        raise InvalidArgument(
            f"failed to parse the request JSON buffer: {text} at {exc.pos}"
        ) from None
    except ValueError as exc:  # not UTF-8
        raise InvalidArgument(f"failed to parse the request JSON buffer: {exc}") from None


def _load_request(body: RequestBody) -> tuple[str, str]:
    """``model_name`` and ``url`` of a load's JSON body (ParseSageMakerRequest)."""
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise InvalidArgument("the request body must be a JSON object")
    values = []
    for key in ("model_name", "url"):
        value = doc.get(key)
        if not isinstance(value, str) or not value:
            raise InvalidArgument(f'the load request needs "{key}", a non-empty string')
        values.append(value)
    return values[0], values[1]


def mme_disabled(load: bool = False) -> Handler:
    """An MME route's answer while it is off: 404 saying how it is turned on; a
    load's malformed body is first its 400, as Triton parses it first
    (sagemaker_server.cc:241, :305-306)."""
    message = (
        "the SageMaker multi-model endpoint is off: --sagemaker-multi-model-root is "
        "empty (it names the directory under which requests may load models)"
    )
    response = _json({"error": message}, 404)

    async def answer(headers: Headers, body: RequestBody) -> Response:
        if load:
            try:
                parse_json(body)
            except InvalidArgument as error:
                return _json({"error": error.message}, 400)
        return response

    return answer
