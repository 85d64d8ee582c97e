"""Triton's test and example backends, served in-process by the same ``backend:`` names.

Triton ships small C++ backends that its tutorials and QA suites use to test a
pipeline without a real model; here each is a Python module with the behaviour its
source defines (each docstring cites the file and lines):

- ``identity`` (triton-inference-server/identity_backend ``src/identity.cc``):
  ``OUTPUT<i>`` is ``INPUT<i>``;
- ``repeat`` (repeat_backend ``src/repeat.cc``) and ``square`` (square_backend
  ``src/square.cc``): decoupled models that answer one request with many responses;
- ``minimal`` and ``recommended`` (backend ``examples/backends/``): the tutorial's
  batched copy of one tensor;
- ``sequence``, ``dyna_sequence`` and ``implicit_state`` (server
  ``src/test/<name>/src/<name>.cc``): the accumulators the sequence batcher's QA
  suites check, and the implicit-state API's error paths;
- ``iterative_sequence`` (server ``src/test/iterative_sequence``): a decoupled
  countdown that hands its request back to an iterative sequence batcher.

Their instances run on the event loop (:class:`~.common.ReferenceInstance`): what
they compute is a copy or a sum, and their configured delays are Trio sleeps, so
an unload cancels them cleanly. Registered in :mod:`trionserve.backends.registry`.
"""
