"""python_backend's native module, for models that import it by name.

In Triton, ``c_python_backend_utils`` is the stub's embedded module (pb_stub.cc,
``PYBIND11_EMBEDDED_MODULE(c_python_backend_utils, ...)``) whose classes
``triton_python_backend_utils`` re-exports; some models import it directly
(``import c_python_backend_utils as c_utils``). Here the classes are those of
``triton_python_backend_utils``, and ``shared_memory`` reports the stub's own
shared-memory arena.
"""

import triton_python_backend_utils as _pb
from triton_python_backend_utils import (  # noqa: F401  (the module's names)
    InferenceRequest,
    InferenceResponse,
    InferenceResponseSender,
    InferenceTrace,
    Logger,
    Metric,
    MetricFamily,
    PreferredMemory,
    ResponseIterator,
    Tensor,
    TritonError,
    TritonModelException,
)


class SharedMemory:
    """What pb_stub.cc's ``SharedMemory`` offers models: ``free_memory()``."""

    def free_memory(self) -> int:
        """Bytes of the stub's arena not allocated now (0 for an in-process model,
        which has none)."""
        runtime = _pb._runtime
        if runtime is None or runtime.arena is None:
            return 0
        arena = runtime.arena
        return arena.size - arena.in_use()


shared_memory = SharedMemory()
