"""The control plane's names for what the data plane also names: checked against each other."""

from __future__ import annotations

from pdconnector.protocol.params import EngineRole
from pdoperator.render.names import ENGINE_ROLES, ComponentRole


def test_the_engine_components_are_the_data_planes_engine_roles() -> None:
    assert [role.value for role in ENGINE_ROLES] == [role.value for role in EngineRole]


def test_every_component_role_but_the_router_is_an_engine_role() -> None:
    assert set(ComponentRole) - set(ENGINE_ROLES) == {ComponentRole.ROUTER}
