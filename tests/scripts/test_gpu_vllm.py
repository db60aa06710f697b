"""The route of vLLM to the GPU machine (scripts/gpu_vllm.py), with small stand-in wheels: packing into pieces
that fit a machine call, and the GPU side's reassembly, install and start-up workarounds."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_vllm", REPO / "scripts" / "gpu_vllm.py")
assert _spec is not None and _spec.loader is not None
gpu_vllm = importlib.util.module_from_spec(_spec)
sys.modules["gpu_vllm"] = gpu_vllm  # dataclasses look their module up by name
_spec.loader.exec_module(gpu_vllm)
MIB = gpu_vllm.MIB
Item = gpu_vllm.Item

FA_INIT = (
    "from x import FA2_AVAILABLE, FA3_AVAILABLE\n"
    "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError\n"
)


def write_wheel(path: Path, files: dict[str, bytes]) -> Path:
    name, version = path.name.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_parts_get_a_piece_each_and_wheels_fill_the_last_pieces_room_first():
    parts = [Item("a.part-1", 56 * MIB), Item("a.part-2", 11 * MIB)]
    wheels = [Item(f"w{i}.whl", 3 * MIB) for i in range(10)]
    pieces = gpu_vllm.plan_pieces(parts, wheels, capacity=58 * MIB)
    assert [p[0].name for p in pieces] == ["a.part-1", "a.part-2"]
    assert all(sum(i.size for i in p) <= 58 * MIB for p in pieces)
    assert sum(len(p) for p in pieces) == 12 and len(pieces[1]) == 11


def test_wheels_that_do_not_fit_open_new_pieces_and_an_oversized_one_is_refused():
    pieces = gpu_vllm.plan_pieces(
        [Item("a.part-1", 50 * MIB)], [Item("big.whl", 30 * MIB)], capacity=56 * MIB
    )
    assert [[i.name for i in p] for p in pieces] == [["a.part-1"], ["big.whl"]]
    with pytest.raises(ValueError, match="alone exceeds"):
        gpu_vllm.plan_pieces([], [Item("huge.whl", 60 * MIB)], capacity=56 * MIB)


def test_the_real_archives_pieces_each_fit_one_call_with_the_tree(tmp_path):
    """The sizes scripts/fetch-gpu-vllm.sh --dry-run reports: the 66.6 MiB archive, 20 MiB of wheels, this
    tree."""
    for i in range(35):
        (tmp_path / f"w{i}.whl").write_bytes(b"\0" * (20 * MIB // 35))
    tree = 5 * MIB
    pieces = gpu_vllm.layout(69_867_688, tmp_path, tree)
    assert len(pieces) == 2
    assert all(sum(i.size for i in p) + tree <= 64 * MIB for p in pieces)
    assert max(i.size for p in pieces for i in p) <= 56 * MIB


def test_pack_then_install_piece_by_piece_reassembles_installs_and_disables_the_fa_guard(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(gpu_vllm, "PART_LIMIT_MIB", 0.05)  # several parts from a small stand-in
    download, wheels, root = tmp_path / "download", tmp_path / "wheels", tmp_path / "tree" / ".gpu-vllm"
    for folder in (download, wheels, root):
        folder.mkdir(parents=True)
    noise = random.Random(0).randbytes(150_000)  # xz cannot shrink it: the archive needs several parts
    wheel = write_wheel(
        download / "vllm-0.32.0-py3-none-any.whl",
        {
            "vllm/__init__.py": b"__version__ = '0.32.0'\n",
            "vllm/blob.bin": noise,
            "vllm/vllm_flash_attn/__init__.py": FA_INIT.encode(),
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"built for torch 2.13",
            "vllm/vllm-rs": b"binary",
            "vllm/__pycache__/x.cpython-312.pyc": b"stale",
        },
    )
    write_wheel(wheels / "extra-1.0-py3-none-any.whl", {"extra.py": b"X = 1\n"})
    folders = gpu_vllm.pack(root, wheel, wheels, tree_bytes=MIB)
    assert len(folders) >= 3, "three parts of 50 KiB, the wheel in the last piece"
    manifest = json.loads((folders[0] / gpu_vllm.MANIFEST).read_text())
    assert manifest["pieces"] == len(folders)
    assert manifest["files"]["extra-1.0-py3-none-any.whl"]["piece"] == len(folders)

    dest = tmp_path / "dest"
    dest.mkdir()
    # one call per piece, as on the GPU machine: the tree holds only that call's piece
    for number, folder in enumerate(folders, start=1):
        carried = tmp_path / f"call-{number}"
        (carried / ".gpu-vllm").mkdir(parents=True)
        folder.rename(carried / ".gpu-vllm" / folder.name)
        done = subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "gpu_vllm.py"),
                "install",
                "--tree",
                str(carried),
                "--dest",
                str(dest),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if number < len(folders):
            assert done.returncode == 0 and f"WAITING: {number} of {len(folders)} pieces" in done.stdout, (
                done.stdout
            )
            assert f"next carry .gpu-vllm/piece-{number + 1}" in done.stdout
    # no CUDA and no compiled ops in the stand-in: installed, and the check says so
    assert done.returncode == 1 and "NOT READY" in done.stdout, done.stdout + done.stderr
    site_packages = dest / "site-packages"
    assert (site_packages / "extra.py").exists() and (
        site_packages / "vllm" / "blob.bin"
    ).read_bytes() == noise
    assert not (site_packages / "vllm" / "vllm-rs").exists()
    assert not (site_packages / "vllm" / "vllm_flash_attn" / "_vllm_fa2_C.abi3.so").exists()
    assert not (site_packages / "vllm" / "__pycache__").exists()
    init = (site_packages / "vllm" / "vllm_flash_attn" / "__init__.py").read_text()
    assert gpu_vllm.FA_GUARD not in init and gpu_vllm.FA_GUARD_OFF in init
    site = (dest / "site.env").read_text()
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in site and "PDCTL_VLLM_GPU_ARGS=" in site
    activate = (dest / "activate.sh").read_text()
    assert str(site_packages) in activate and f"PDCTL_SITE={dest / 'site.env'}" in activate
    # the product's manifest was never touched: the workaround lives in the scratch copy only
    assert FA_INIT in zipfile.ZipFile(wheel).read("vllm/vllm_flash_attn/__init__.py").decode()
