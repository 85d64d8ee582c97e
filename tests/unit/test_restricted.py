"""The restricted-API flags' parser and header checks (trionserve.protocol.restricted)."""

from __future__ import annotations

import pytest

from trionserve.protocol.restricted import (
    GRPC_HEADER_PREFIX,
    RestrictedCategory,
    Restriction,
    parse_restricted_features,
)


def test_groups_of_several_flags_each_get_their_header():
    features = parse_restricted_features(
        ["model-repository,trace:admin-key=admin=value", "inference:k=v:w"],
        "--grpc-restricted-protocol",
        "protocol",
        GRPC_HEADER_PREFIX,
    )
    admin = Restriction("triton-grpc-protocol-admin-key", "admin=value")
    assert features.get(RestrictedCategory.MODEL_REPOSITORY) == admin
    assert features.get(RestrictedCategory.TRACE) == admin
    # The first ':' ends the groups and the first '=' after it the key; the
    # value keeps the rest (Triton's ParseGenericConfigOption).
    assert features.get(RestrictedCategory.INFERENCE) == Restriction(
        "triton-grpc-protocol-k", "v:w"
    )
    assert features.get(RestrictedCategory.HEALTH) is None
    assert not parse_restricted_features([], "--http-restricted-api", "api")


@pytest.mark.parametrize("malformed", ["health", "health:k1", "health:=v", ":k=v", "health:k="])
def test_malformed_setting_is_refused_with_tritons_message(malformed):
    with pytest.raises(ValueError) as info:
        parse_restricted_features([malformed], "--http-restricted-api", "api")
    assert str(info.value) == (
        f"--http-restricted-api option format is '<config name>:<setting>=<value>'. Got {malformed}"
    )


def test_unknown_and_repeated_groups_are_refused():
    with pytest.raises(ValueError, match="unknown restricted api 'infer'"):
        parse_restricted_features(["infer:k=v"], "--http-restricted-api", "api")
    with pytest.raises(ValueError, match="unknown restricted protocol ''"):
        parse_restricted_features(["health,:k=v"], "--grpc-restricted-protocol", "protocol")
    with pytest.raises(
        ValueError, match="restricted api 'health' can not be specified in multiple config groups"
    ):
        parse_restricted_features(["health:a=b", "metadata,health:c=d"], "--x", "api")


def test_headers_match_by_name_case_insensitively_and_by_value_exactly():
    http = Restriction("Admin-Key", "Secret")
    assert http.admits_http([(b"other", b"x"), (b"admin-key", b"Secret")])
    assert not http.admits_http([(b"admin-key", b"secret")])
    # The first header of the name counts, as libevhtp's lookup finds it.
    assert not http.admits_http([(b"admin-key", b"no"), (b"admin-key", b"Secret")])
    assert not http.admits_http([])
    grpc = Restriction("triton-grpc-protocol-k", "v")
    assert grpc.admits_grpc([("triton-grpc-protocol-k", "v")])
    assert not grpc.admits_grpc([("k", "v"), ("triton-grpc-protocol-k", "w")])
