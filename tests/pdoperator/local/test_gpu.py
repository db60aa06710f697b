"""Local vLLM engines on GPUs: the site file, each engine's GPUs and memory share, and the plan they give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pdoperator.api import parse_pdservice
from pdoperator.local import LocalProcess, LocalRunError, local_variant, plan_local_run
from pdoperator.local.gpu import (
    DEFAULT_GPU_MEMORY_FRACTION,
    LocalSite,
    SiteError,
    load_site,
    place_engines,
    visible_gpus,
    with_site_args,
)
from pdoperator.local.runner import boot_waves
from pdoperator.render import ComponentRole, RenderDefaults, render_pdservice

REPO = Path(__file__).resolve().parents[3]
H200_SITE = LocalSite(
    gpus=1,
    engine_env={"VLLM_USE_FLASHINFER_SAMPLER": "0"},
    gpu_engine_args=("--attention-backend", "TRITON_ATTN", "--enforce-eager"),
    gpu_memory_fraction=0.3,
    source="site.env",
)


def example(name: str, **replicas: int):
    document = yaml.safe_load((REPO / "examples" / name).read_text())
    for role, count in replicas.items():
        document["spec"][role]["replicas"] = count
    return parse_pdservice(document)


def gpu_plan(tmp_path, site=H200_SITE, **replicas):
    pds = example("tiny-gpu-vllm.yaml", **replicas)
    manifests = render_pdservice(pds, RenderDefaults())
    return plan_local_run(pds, manifests, tmp_path, model_dir=tmp_path / "model", site=site)


def flag(argv, name):
    argv = list(argv)
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last occurrence wins in vLLM's parser


@pytest.mark.parametrize(
    ("fraction", "engines", "share"),
    [(0.9, 1, 0.9), (0.9, 2, 0.45), (0.3, 2, 0.15), (0.3, 3, 0.1), (0.9, 7, 0.12)],
)
def test_engines_sharing_a_gpu_split_the_sites_fraction_rounded_down(fraction, engines, share):
    site = LocalSite(gpus=1, gpu_memory_fraction=fraction)
    placements = place_engines([1] * engines, site)
    assert {p.memory_share for p in placements} == {share}
    assert sum(p.memory_share for p in placements) <= fraction + 1e-9
    assert {p.gpus for p in placements} == {(0,)}


def test_engines_spread_over_gpus_before_they_share_and_a_tp_engine_gets_distinct_gpus():
    site = LocalSite(gpus=4, gpu_memory_fraction=0.8)
    placements = place_engines([1, 1, 2, 1], site)
    assert [p.gpus for p in placements] == [(0,), (1,), (2, 3), (0,)]
    # GPU 0 holds two engines; the TP-2 engine is alone on 2 and 3
    assert [p.memory_share for p in placements] == [0.4, 0.8, 0.8, 0.4]
    assert placements[2].visible_devices == "2,3"


def test_an_engine_needing_more_gpus_than_the_machine_has_or_none_at_all_is_refused():
    with pytest.raises(SiteError, match="needs 2 GPUs and this machine has 1"):
        place_engines([2], LocalSite(gpus=1))
    with pytest.raises(SiteError, match="no GPU"):
        place_engines([1], LocalSite(gpus=0))


def test_gpus_are_counted_from_the_driver_device_nodes_narrowed_by_cuda_visible_devices(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (tmp_path / name).touch()
    assert visible_gpus(tmp_path, {}) == 2
    assert visible_gpus(tmp_path, {"CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert visible_gpus(tmp_path, {"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_the_site_file_splits_into_pdctl_settings_and_engine_environment(tmp_path):
    (tmp_path / "nvidia0").touch()
    site_file = tmp_path / "site.env"
    site_file.write_text(
        "# written by scripts/gpu-vllm.sh\nVLLM_USE_FLASHINFER_SAMPLER=0\n"
        "PDCTL_VLLM_GPU_ARGS='--attention-backend TRITON_ATTN "
        "--enforce-eager'\nPDCTL_GPU_MEMORY_FRACTION=0.3\n"
    )
    site = load_site({"PDCTL_SITE": str(site_file)}, dev=tmp_path)
    assert site == LocalSite(
        1, {"VLLM_USE_FLASHINFER_SAMPLER": "0"}, H200_SITE.gpu_engine_args, 0.3, str(site_file)
    )
    assert load_site({}, dev=tmp_path) == LocalSite(gpus=1, gpu_memory_fraction=DEFAULT_GPU_MEMORY_FRACTION)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("PDCTL_GPU_MEMORY_FRACTION=1.5\n", r"must be in \(0, 1\]"),
        ("PDCTL_TYPO=1\n", "unknown pdctl settings"),
        ("not a setting\n", "expected KEY=VALUE"),
    ],
)
def test_a_bad_site_file_is_refused_with_its_line(tmp_path, text, error):
    (tmp_path / "site.env").write_text(text)
    with pytest.raises(SiteError, match=error):
        load_site({"PDCTL_SITE": str(tmp_path / "site.env")}, dev=tmp_path)


def test_the_specs_own_flags_win_over_the_sites():
    site = LocalSite(gpus=1, gpu_engine_args=("--attention-backend", "TRITON_ATTN", "--enforce-eager"))
    placement = place_engines([1], site)[0]
    argv = with_site_args(
        ["--attention-backend", "FLASH_ATTN", "--gpu-memory-utilization=0.5"], site, placement
    )
    assert argv == ["--attention-backend", "FLASH_ATTN", "--gpu-memory-utilization=0.5", "--enforce-eager"]


def test_a_gpu_spec_runs_vllm_on_the_gpu_with_cuda_kv_buffers_shares_and_the_sites_env(tmp_path):
    plan = gpu_plan(tmp_path)
    engines = [p for p in plan.processes if p.role is not ComponentRole.ROUTER]
    assert len(engines) == 2
    for engine in engines:
        assert flag(engine.argv, "--gpu-memory-utilization") == "0.15"
        assert flag(engine.argv, "--attention-backend") == "TRITON_ATTN" and "--enforce-eager" in engine.argv
        kv_config = json.loads(flag(engine.argv, "--kv-transfer-config"))
        assert kv_config["kv_buffer_device"] == "cuda"
        assert engine.env["CUDA_VISIBLE_DEVICES"] == "0"
        assert engine.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        assert "VLLM_CPU_KVCACHE_SPACE" not in engine.env and "VLLM_CPU_OMP_THREADS_BIND" not in engine.env
        assert engine.env["HF_HUB_OFFLINE"] == "1"


def test_more_engines_on_one_gpu_take_smaller_shares(tmp_path):
    plan = gpu_plan(tmp_path, prefill=2, decode=2)
    shares = {
        flag(p.argv, "--gpu-memory-utilization") for p in plan.processes if p.role is not ComponentRole.ROUTER
    }
    assert shares == {"0.07"}


def test_the_rendered_manifests_carry_none_of_the_sites_settings():
    pds = example("tiny-gpu-vllm.yaml")
    text = json.dumps(render_pdservice(pds, RenderDefaults()))
    for setting in (
        "TRITON_ATTN",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "VLLM_USE_FLASHINFER_SAMPLER",
    ):
        assert setting not in text


def test_a_gpu_spec_on_a_machine_without_gpus_is_refused_naming_the_field(tmp_path):
    with pytest.raises(
        LocalRunError, match=r"spec\.prefill: 1 GPUs per engine and .* has 0; .*resources\.gpus: 0"
    ):
        gpu_plan(tmp_path, site=LocalSite(gpus=0))


def test_the_cpu_path_is_unchanged_by_a_site(tmp_path):
    pds = local_variant(example("tiny-cpu.yaml"), runtime="vllm")
    plan = plan_local_run(
        pds, render_pdservice(pds, RenderDefaults()), tmp_path, model_dir=tmp_path / "model", site=H200_SITE
    )
    engine = plan.processes[0]
    assert "--gpu-memory-utilization" not in engine.argv and "CUDA_VISIBLE_DEVICES" not in engine.env
    assert engine.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" in engine.env


def test_engines_sharing_a_gpu_boot_one_after_the_other_and_the_others_side_by_side():
    """vLLM profiles the GPU's memory while it starts: a neighbour allocating then is counted as its own."""

    def engine(name: str, gpus: str | None) -> LocalProcess:
        env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus}
        return LocalProcess(name, ComponentRole.PREFILL, ("vllm",), env, "127.0.0.1", 8000)

    engines = [
        engine("p0", "0"),
        engine("d0", "0"),
        engine("p1", "1"),
        engine("tp2", "0,1"),
        engine("cpu", None),
    ]
    waves = [[local.name for local in wave] for wave in boot_waves(engines)]
    assert waves == [["p0", "p1", "cpu"], ["d0"], ["tp2"]]
