"""The image Dockerfiles, checked by parsing (no Docker engine runs here to build them)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: REPO / "images" / name / "Dockerfile" for name in ("operator", "engine")}
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|PRIVATE_KEY)", re.IGNORECASE)
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|build-essential|make|cmake|clang)\b")


def parse(name: str) -> DockerfileParser:
    return DockerfileParser(str(DOCKERFILES[name]))


def final_stage(parser: DockerfileParser) -> list[dict[str, str]]:
    instructions = parser.structure
    last_from = max(i for i, item in enumerate(instructions) if item["instruction"] == "FROM")
    return instructions[last_from:]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_are_pinned_to_a_version(name: str) -> None:
    for image in parse(name).parent_images:
        assert ":" in image, f"{name}: base image {image} has no tag"
        tag = image.rsplit(":", 1)[1]
        assert tag != "latest"
        assert re.search(r"\d+\.\d+", tag), f"{name}: base image {image} is not pinned to a version"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_secrets_are_baked_in(name: str) -> None:
    for item in parse(name).structure:
        if item["instruction"] in {"ENV", "ARG", "LABEL"}:
            assert not SECRET_NAME.search(item["value"]), f"{name}: {item['content'].strip()}"
        if item["instruction"] in {"COPY", "ADD"}:
            assert not re.search(r"(\.env|credentials|id_rsa|\.pem|kubeconfig)", item["value"]), item[
                "content"
            ]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copied_sources_exist_in_the_repository(name: str) -> None:
    for item in parse(name).structure:
        if item["instruction"] == "COPY" and "--from" not in item["value"]:
            *sources, _destination = item["value"].split()
            for source in sources:
                assert (REPO / source).exists(), f"{name}: COPY {source} does not exist"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_carry_the_project_version_in_their_labels(name: str) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    parser = parse(name)
    assert parser.labels["org.opencontainers.image.version"] == version
    assert parser.labels["org.opencontainers.image.source"]


def test_operator_image_runs_as_a_non_root_user_without_build_tools() -> None:
    stage = final_stage(parse("operator"))
    users = [item["value"] for item in stage if item["instruction"] == "USER"]
    assert users, "the final stage sets no USER"
    assert users[-1].split(":")[0] not in {"0", "root"}
    for item in stage:
        if item["instruction"] == "RUN":
            assert not BUILD_TOOLS.search(item["value"]), item["content"]
            assert "apt-get install" not in item["value"]


def test_operator_image_installs_only_from_prebuilt_wheels_in_its_final_stage() -> None:
    runs = [item["value"] for item in final_stage(parse("operator")) if item["instruction"] == "RUN"]
    assert any("--no-index" in run for run in runs)


def test_engine_image_pins_vllm_nixl_and_efa_and_skips_the_kernel_module() -> None:
    parser = parse("engine")
    args = {
        key: value
        for item in parser.structure
        if item["instruction"] == "ARG"
        for key, _, value in [item["value"].partition("=")]
    }
    assert args["VLLM_IMAGE"].endswith(":v0.32.0")
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["NIXL_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["EFA_INSTALLER_VERSION"])
    installer = next(
        item["value"]
        for item in parser.structure
        if item["instruction"] == "RUN" and "efa_installer.sh" in item["value"]
    )
    assert "--skip-kmod" in installer
    assert "--skip-limit-conf" in installer
    env = parser.envs
    assert "/opt/amazon/efa/lib" in env["LD_LIBRARY_PATH"]
    assert env["FI_PROVIDER"] == "efa"


def test_build_context_excludes_local_state() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    for entry in (".venv", ".git", ".cache"):
        assert entry in ignored
