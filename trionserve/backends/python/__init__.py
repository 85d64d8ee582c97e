"""Python backend: Triton's ``model.py`` API, each instance in its own stub process.

Server side: :mod:`.backend` (the ``backend: "python"`` Backend), :mod:`.instance`
(one instance: its stub process, crash and hang handling, BLS, decoupled
responses), :mod:`.lane_calls` (its executes on the lane and the reading of the
stub's replies), :mod:`.process` (spawning and talking to a stub), :mod:`.messages`
(requests and responses as control messages). Both sides: :mod:`.wire` (message
framing) and :mod:`.shm` (shared-memory arenas for tensors). Stub side:
:mod:`.stub` and ``stubpath/triton_python_backend_utils.py``, the module models
import as ``pb_utils`` (its data types, errors, ``Tensor`` and ``ModelConfig`` in
sibling modules of ``stubpath/``).

This package imports nothing on purpose: the stub process imports its submodules
and must not pay for the server's.
"""
