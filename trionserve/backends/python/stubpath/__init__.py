"""The directory a stub process puts on ``sys.path`` for the models it runs.

It holds ``triton_python_backend_utils.py`` (and the sibling modules it imports its
data types, errors, ``Tensor`` and ``ModelConfig`` from, by top-level name), so that
``import triton_python_backend_utils as pb_utils`` works in ``model.py`` without a
top-level module installed into site-packages. An in-process model loads them all
anew per instance (``trionserve/backends/python/model_namespace.py``). This file
only makes the directory part of the distribution.
"""
