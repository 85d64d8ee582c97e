"""``InferenceSession.run`` as a server calls it, without the per-call checks of
onnxruntime's Python wrapper that cannot fail for the backend's feeds.

The wrapper (``onnxruntime.capi.onnxruntime_inference_collection.Session.run``)
checks, before each call of its C session (``_sess.run``), that WebGPU graph
capture is off, that every required input is fed (reading each input's name and
type through the bindings), and that no fed ``OrtValue`` belongs to another
session; then it runs, and retries once on other execution providers if the
provider failed (``EPFail``). Called right after the previous run, with the
interpreter's working set evicted by the model's activations, those checks cost
~50 µs per call of the small CNN, more than the rest of the backend's Python
(benchmarks/README.md, issue 39's tenth round).

:class:`SessionRun` makes the one check that can fail (the required inputs, a
set compared with the feed's keys) and calls the C session itself; WebGPU graph
capture is looked at once, the feeds are numpy arrays (no ``OrtValue``), and any
call it cannot make so (a missing input, no output named, capture on, a provider
failure) goes to the wrapper, whose errors and fallback are thus unchanged. The
wrapper's internals are read here only, and only where its ``run`` is the one
this was written against (the names its code reads, :data:`KNOWN_WRAPPER`, as in
onnxruntime 1.32): another version's wrapper is called as it is, and
``tests/unit/test_onnxruntime_run.py`` fails on it so that this is looked at again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from onnxruntime import InferenceSession

__all__ = ["SessionRun"]


# What the wrapper's steps read (their code's names), as this module knows them.
KNOWN_WRAPPER = {
    "run": frozenset(
        {
            "C",
            "EPFail",
            "_enable_fallback",
            "_fallback_providers",
            "_outputs_meta",
            "_providers",
            "_sess",
            "_validate_graph_capture_run_api",
            "_validate_input",
            "_validate_ortvalue_ownership",
            "disable_fallback",
            "keys",
            "list",
            "print",
            "run",
            "set_providers",
            "values",
        }
    ),
    "_validate_input": frozenset(
        {"_inputs_meta", "name", "type", "startswith", "append", "ValueError"}
    ),
    "_validate_graph_capture_run_api": frozenset(
        {
            "_sess",
            "is_webgpu_graph_capture_enabled",
            "_graph_annotation_id",
            "_GRAPH_ANNOTATION_SKIP",
            "ValueError",
            "_GPU_GRAPH_ID_RUN_CONFIG_KEY",
        }
    ),
}


def known_wrapper(session: object) -> bool:
    """Whether ``session``'s wrapper steps read what :data:`KNOWN_WRAPPER` says."""
    for name, names in KNOWN_WRAPPER.items():
        code = getattr(getattr(type(session), name, None), "__code__", None)
        if code is None or frozenset(code.co_names) != names:
            return False
    return True


def _provider_failure() -> type[Exception]:
    from onnxruntime.capi import onnxruntime_pybind11_state

    return onnxruntime_pybind11_state.EPFail


class SessionRun:
    """Calls ``session.run(names, feeds)``, the same results and errors, with the
    wrapper's checks made once or by a set comparison where the feeds allow."""

    __slots__ = ("_session", "_required", "_direct", "_failure")

    def __init__(self, session: InferenceSession) -> None:
        self._session = session
        self._required = frozenset(
            i.name for i in session.get_inputs() if not i.type.startswith("optional")
        )
        inner: Any = getattr(session, "_sess", None)
        capture = getattr(inner, "is_webgpu_graph_capture_enabled", None)
        self._direct = (
            inner is not None and capture is not None and not capture() and known_wrapper(session)
        )
        self._failure = _provider_failure()

    def __call__(self, names: list[str], feeds: dict[str, np.ndarray]) -> list:
        if self._direct and names and self._required <= feeds.keys():
            try:
                # The wrapper's session, looked up each call: its fallback replaces it.
                return self._session._sess.run(names, feeds, None)
            except self._failure:
                pass  # the wrapper runs it again and falls back as it does
        return self._session.run(names, feeds)
