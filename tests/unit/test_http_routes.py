"""The HTTP frontend's router keeps the handlers of the infer paths it routed
last (HttpFrontend.route): a path routed again gets the handler it got, bound to
its own model and version, behind its group's restriction; any other method or
path is routed by the table as before."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from trionserve.protocol.http import frontend as http_frontend
from trionserve.protocol.http.frontend import HttpFrontend
from trionserve.protocol.restricted import (
    RestrictedCategory,
    RestrictedFeatures,
    Restriction,
)


def make(restricted: RestrictedFeatures | None = None) -> HttpFrontend:
    plane = SimpleNamespace(tracing=SimpleNamespace(active=False))
    return HttpFrontend(plane, restricted_apis=restricted)  # type: ignore[arg-type]


def answer(handler, headers=()) -> int:
    async def run() -> int:
        status, _, _ = await handler(list(headers), b"")
        return status

    return trio.run(run)


def test_an_infer_path_routed_again_gets_the_handler_bound_to_its_own_model():
    frontend = make()
    first = frontend.route(b"POST", "/v2/models/a/infer")
    assert frontend.route(b"POST", "/v2/models/a/infer") is first
    assert first.args[0].group(1, 2) == ("a", None)
    other = frontend.route(b"POST", "/v2/models/b/versions/2/infer")
    assert other is not first and other.args[0].group(1, 2) == ("b", "2")
    assert frontend.route(b"POST", "/v2/models/a/infer") is first


def test_other_methods_and_paths_are_routed_by_the_table():
    frontend = make()
    frontend.route(b"POST", "/v2/models/a/infer")
    assert answer(frontend.route(b"GET", "/v2/models/a/infer")) == 405
    assert answer(frontend.route(b"POST", "/v2/models/a/infer/x")) == 404
    assert answer(frontend.route(b"POST", "/v2/models/a/ready")) == 405
    assert "/v2/models/a/infer/x" not in frontend._infer_routes


def test_the_kept_handlers_are_bounded():
    frontend = make()
    for n in range(3 * http_frontend._INFER_ROUTES):
        path = f"/v2/models/m{n}/infer"
        handler = frontend.route(b"POST", path)
        assert handler.args[0].group(1) == f"m{n}"
        assert len(frontend._infer_routes) <= http_frontend._INFER_ROUTES


def test_a_kept_handler_keeps_its_restriction():
    restriction = Restriction(header="infer-key", value="yes")
    frontend = make(RestrictedFeatures({RestrictedCategory.INFERENCE: restriction}))
    for _ in range(2):  # routed, then kept
        handler = frontend.route(b"POST", "/v2/models/a/infer")
        assert answer(handler) == 403
