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
wrapper's internals are read here only; ``tests/unit/test_onnxruntime_run.py``
fails when onnxruntime changes what its ``run`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from onnxruntime import InferenceSession

__all__ = ["SessionRun"]


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
        self._direct = inner is not None and not (capture is not None and capture())
        self._failure = _provider_failure()

    def __call__(self, names: list[str], feeds: dict[str, np.ndarray]) -> list:
        if self._direct and names and self._required <= feeds.keys():
            try:
                # The wrapper's session, looked up each call: its fallback replaces it.
                return self._session._sess.run(names, feeds, None)
            except self._failure:
                pass  # the wrapper runs it again and falls back as it does
        return self._session.run(names, feeds)
