"""Backends from the config: pod DNS names resolved to addresses, failures tolerated, coordinates for push."""

from __future__ import annotations

from pdconnector.protocol.params import EngineRole
from pdconnector.router.discovery import AddressBook, backend_specs, resolve_address


async def test_literal_addresses_and_local_names_resolve():
    assert await resolve_address("127.0.0.7") == "127.0.0.7"
    assert await resolve_address("localhost") in ("127.0.0.1", "::1")


async def test_names_that_do_not_resolve_keep_their_last_address(cluster):
    config = cluster.config()
    book = AddressBook()
    await book.refresh(config)
    assert book.addresses == {e.host: e.host for e in cluster.prefill + cluster.decode}
    book.addresses["p0.tiny-prefill.default.svc.cluster.local"] = "10.1.2.3"
    renamed = cluster.config(
        prefill={
            "service": "tiny-prefill",
            "namespace": "default",
            "http_port": 8000,
            "replicas": 1,
            "backends": [
                {"name": "p0", "host": "p0.tiny-prefill.default.svc.cluster.local", "engine_id": "p0-c0ffee"}
            ],
        }
    )
    await book.refresh(renamed)  # the name does not resolve here: the previous answer stays
    specs = backend_specs(renamed, book.addresses)
    prefill = next(s for s in specs if s.role is EngineRole.PREFILL)
    assert prefill.host == "10.1.2.3"


async def test_unresolved_names_are_used_as_they_are():
    assert await resolve_address("no-such-pod.invalid") is None


def test_prefill_coordinates_carry_engine_id_address_side_channel_and_tp(cluster):
    config = cluster.config()
    specs = backend_specs(config, {cluster.prefill[0].host: "10.0.0.9"})
    p0 = next(s for s in specs if s.name == "p0")
    coordinates = p0.prefill_coordinates()
    assert (coordinates.engine_id, coordinates.host, coordinates.side_channel_port, coordinates.tp_size) == (
        "p0-c0ffee",
        "10.0.0.9",
        5600,
        1,
    )
    assert all(s.compat_hash == "c0ffee" for s in specs)
    assert p0.base_url == f"http://10.0.0.9:{cluster.prefill_port}"
