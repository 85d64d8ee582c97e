"""The directory a stub process puts on ``sys.path`` for the models it runs.

It holds ``triton_python_backend_utils.py``, so that ``import
triton_python_backend_utils as pb_utils`` works in ``model.py`` without a top-level
module installed into site-packages. This file only makes the directory part of
the distribution.
"""
