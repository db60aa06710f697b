"""The rendered engine command lines against the installed vLLM: its own argument parser and KV connector
registry."""

from __future__ import annotations

import argparse

import pytest
from pdoperator.render import RenderDefaults, render_pdservice


@pytest.fixture(scope="module")
def vllm_server_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: PLC0415 (vLLM imports take seconds)
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    return make_arg_parser(FlexibleArgumentParser())


def vllm_engine_args(pds):
    for obj in render_pdservice(pds, RenderDefaults()):
        if obj["kind"] == "StatefulSet":
            (engine,) = obj["spec"]["template"]["spec"]["containers"]
            assert engine["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
            yield obj["metadata"]["name"], engine["args"]


def parse(parser, args):
    try:
        return parser.parse_args(args)
    except SystemExit as error:
        pytest.fail(f"vLLM rejected {args}: exit {error.code}")


def test_vllm_parses_every_engine_command_line_of_the_gpu_examples_and_variants(
    vllm_server_parser, example_pds, make_pds
):
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args  # noqa: PLC0415

    services = [
        example_pds("qwen3-32b-push-efa"),
        example_pds("nemotron-nano-hybrid"),
        make_pds({"mode": "pull", "engine": {"connector": "vllm"}, "prefill": {"enablePrefixCaching": True}}),
        make_pds(
            {
                "engine": {"connector": "vllm", "prefillEngineId": "fixed"},
                "model": {"source": {"pvc": {"claimName": "w", "path": "m"}}},
            }
        ),
    ]
    for pds in services:
        for name, args in vllm_engine_args(pds):
            parsed = parse(vllm_server_parser, args)
            validate_parsed_serve_args(parsed)
            config = parsed.kv_transfer_config
            assert config.kv_role == ("kv_producer" if name.endswith("prefill") else "kv_consumer"), name
            assert config.engine_id
            assert parsed.tensor_parallel_size >= 1


def test_vllm_sees_prefix_caching_off_on_both_hybrid_roles(vllm_server_parser, example_pds):
    parsed = dict(vllm_engine_args(example_pds("nemotron-nano-hybrid")))
    assert parse(vllm_server_parser, parsed["nemotron-nano-decode"]).enable_prefix_caching is False
    assert parse(vllm_server_parser, parsed["nemotron-nano-prefill"]).enable_prefix_caching is False


def test_the_upstream_connector_names_are_registered_in_vllm(vllm_server_parser, make_pds):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: PLC0415

    for mode in ("push", "pull"):
        pds = make_pds({"mode": mode, "engine": {"connector": "vllm", "prefillEngineId": "fixed"}})
        for _, args in vllm_engine_args(pds):
            name = parse(vllm_server_parser, args).kv_transfer_config.kv_connector
            assert name in KVConnectorFactory._registry, name
