"""The base of every API model: the wire conventions and the string formats Kubernetes defines."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base for every API object: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=False,
        validate_default=True,
    )


# Names of Kubernetes objects (RFC 1123 subdomain) and env var names.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_VAR_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
