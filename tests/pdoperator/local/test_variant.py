"""pdctl up's overrides: what the engines are, which connector vLLM loads, the mode; validated like any
PDService."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pdoperator.api import ConnectorImpl, Runtime, SpecError, TransferMode, TransportBackend, parse_pdservice
from pdoperator.local import local_variant

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def tiny():
    return parse_pdservice(yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text()))


def test_no_overrides_keep_the_pdservice(tiny):
    assert local_variant(tiny) == tiny


def test_vllm_engines_move_kv_over_nixl_instead_of_the_mock_transport(tiny):
    variant = local_variant(tiny, runtime="vllm", mode="pull")
    assert variant.spec.engine.runtime is Runtime.VLLM and variant.spec.mode is TransferMode.PULL
    assert variant.spec.engine.transport.backend is TransportBackend.UCX
    assert (variant.name, variant.namespace, variant.spec.model) == (
        tiny.name,
        tiny.namespace,
        tiny.spec.model,
    )


def test_back_to_mock_engines_restores_the_mock_transport(tiny):
    assert (
        local_variant(local_variant(tiny, runtime="vllm"), runtime="mock").spec.engine.transport.backend
        is TransportBackend.MOCK
    )


def test_upstream_push_gets_the_fixed_prefill_engine_id_it_needs(tiny):
    variant = local_variant(tiny, runtime="vllm", connector="vllm")
    assert variant.spec.engine.connector is ConnectorImpl.VLLM
    assert variant.spec.engine.prefill_engine_id == "tiny-prefill"
    assert (
        local_variant(tiny, runtime="vllm", connector="vllm", mode="pull").spec.engine.prefill_engine_id
        is None
    )


def test_an_override_that_makes_the_spec_invalid_names_the_field(tiny):
    with pytest.raises(SpecError) as raised:
        local_variant(tiny, connector="vllm")
    assert any(problem.path == "spec.engine.connector" for problem in raised.value.errors)
