"""Restricted API groups: a header (and its value) that the requests of a group must carry.

``--http-restricted-api=<api>[,<api>...]:<key>=<value>`` and
``--grpc-restricted-protocol=<protocol>[,...]:<key>=<value>``, as Triton defines
them (server ``src/restricted_features.h``, ``src/command_line_parser.cc``
``ParseRestrictedFeatureOption``): each flag names one or more of Triton's
groups, a group may be named by one flag only, and a request to an endpoint of
a restricted group is refused unless it carries the header ``<key>`` (over gRPC
``triton-grpc-protocol-<key>``) with exactly ``<value>``. Which endpoint belongs to
which group is the route table's business (the HTTP frontend and the gRPC
service); this module parses the flags and answers whether headers satisfy a
restriction.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

# The gRPC header of a restriction is this prefix and the flag's key
# (Triton's src/grpc/grpc_server.h, kRestrictedProtocolHeaderTemplate).
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


class RestrictedCategory(enum.Enum):
    """Triton's API groups (``RESTRICTED_CATEGORY_NAMES``), by their flag names."""

    HEALTH = "health"
    METADATA = "metadata"
    INFERENCE = "inference"
    SHARED_MEMORY = "shared-memory"
    MODEL_CONFIG = "model-config"
    MODEL_REPOSITORY = "model-repository"
    STATISTICS = "statistics"
    TRACE = "trace"
    LOGGING = "logging"


@dataclass(frozen=True, slots=True)
class Restriction:
    """The header a restricted group's requests must carry, and its value."""

    header: str  # as the client must send it (gRPC's prefix included)
    value: str

    def admits_http(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether HTTP request headers (lower-case names) carry the header with
        the value; the first header of that name counts, as libevhtp finds it."""
        name = self.header.lower().encode("latin-1")
        for key, value in headers:
            if key == name:
                return value == self.value.encode()
        return False

    def admits_grpc(self, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        """Whether gRPC call metadata carries the header with the value."""
        name = self.header.lower()
        for key, value in metadata:
            if key == name:
                return value == self.value
        return False


@dataclass(frozen=True)
class RestrictedFeatures:
    """The restriction of each restricted group; groups not in it are open."""

    restrictions: Mapping[RestrictedCategory, Restriction] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def get(self, category: RestrictedCategory) -> Restriction | None:
        return self.restrictions.get(category)

    def __bool__(self) -> bool:
        return bool(self.restrictions)


def parse_restricted_features(
    settings: Sequence[str], flag: str, feature_type: str, header_prefix: str = ""
) -> RestrictedFeatures:
    """The restrictions of every ``<group>[,<group>...]:<key>=<value>`` setting of
    ``flag``. ``feature_type`` names a group in errors ("api" for HTTP, "protocol"
    for gRPC), as Triton's messages do. Raises ValueError with Triton's message
    for a malformed setting, an unknown group, or a group named twice."""
    restrictions: dict[RestrictedCategory, Restriction] = {}
    for setting in settings:
        groups, key, value = _split(setting, flag)
        for group in groups.split(","):
            try:
                category = RestrictedCategory(group)
            except ValueError:
                raise ValueError(f"unknown restricted {feature_type} '{group}'") from None
            if category in restrictions:
                raise ValueError(
                    f"restricted {feature_type} '{group}' can not be specified in multiple "
                    "config groups"
                )
            restrictions[category] = Restriction(header_prefix + key, value)
    return RestrictedFeatures(MappingProxyType(restrictions))


def _split(setting: str, flag: str) -> tuple[str, str, str]:
    """``<groups>:<key>=<value>``: the first ':' ends the groups, the first '='
    after it ends the key (Triton's ParseGenericConfigOption); none may be empty."""
    groups, colon, rest = setting.partition(":")
    key, equals, value = rest.partition("=")
    if not colon or not equals or not groups or not key or not value:
        raise ValueError(
            f"--{flag.lstrip('-')} option format is '<config name>:<setting>=<value>'. "
            f"Got {setting}"
        )
    return groups, key, value
