"""NixlTransport specifics beyond the shared contract."""

from __future__ import annotations

import pytest
from pdconnector.transport import NixlTransport, TransportError, nixl_unavailable_reason


@pytest.fixture(autouse=True)
def _nixl_importable() -> None:
    if (reason := nixl_unavailable_reason()) is not None:
        pytest.fail(f"NIXL must be importable here (make test installs it): {reason}")


def test_an_unavailable_backend_is_refused_by_name() -> None:
    with pytest.raises(TransportError, match=r"backend\(s\) \['NO_SUCH_BACKEND'\] unavailable"):
        NixlTransport("backend-check", backends=("NO_SUCH_BACKEND",))


def test_no_backend_at_all_is_refused() -> None:
    with pytest.raises(TransportError, match="at least one backend"):
        NixlTransport("backend-none", backends=())
