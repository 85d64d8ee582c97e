"""Schedulers: the queue between a model version's submitted requests and its
executors, one per kind of Triton scheduling (see :mod:`.factory`)."""
