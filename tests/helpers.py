"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], what: str, timeout: float = 30.0, interval: float = 0.02
) -> T:
    """Poll ``predicate`` (state of another process: a server, a cluster, a file)
    until it returns something truthy, and return that; fail naming ``what`` and
    the last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def simple_inputs(
    a: np.ndarray | None = None,
    b: np.ndarray | None = None,
    module: Any = httpclient,
    binary: bool = True,
) -> list:
    """INPUT0 and INPUT1 of the ``simple`` model for ``module`` (tritonclient.http
    or tritonclient.grpc): ``a`` (default ``arange(16)`` as ``[1, 16]`` INT32) and
    ``b`` (default ones shaped as ``a``); ``binary`` picks HTTP's binary tensors."""
    if a is None:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
    if b is None:
        b = np.ones_like(a)
    extra = {"binary_data": binary} if module is httpclient else {}
    inputs = []
    for name, data in (("INPUT0", a), ("INPUT1", b)):
        tensor = module.InferInput(name, list(data.shape), "INT32")
        tensor.set_data_from_numpy(data, **extra)
        inputs.append(tensor)
    return inputs


def expect_error(
    call: Callable[[], object], fragment: str, status: int | str | None = None
) -> InferenceServerException:
    """The tritonclient error ``call`` raises; its message must contain ``fragment``
    and, when given, its status be ``status`` (an HTTP code, or a gRPC code name
    such as ``"INVALID_ARGUMENT"``)."""
    with pytest.raises(InferenceServerException) as info:
        call()
    error = info.value
    assert fragment in error.message(), error.message()
    if status is not None:
        got = str(error.status())
        assert got in (str(status), f"StatusCode.{status}"), got
    return error


def decoupled_model(name: str):
    """What a data-plane stand-in's ``model()`` returns for a decoupled model (the
    gRPC stream answers its requests as they are ready, in any order)."""
    from types import SimpleNamespace

    from trionserve._generated import model_config_pb2 as mc

    config = mc.ModelConfig(name=name)
    config.model_transaction_policy.decoupled = True
    return SimpleNamespace(config=config)
