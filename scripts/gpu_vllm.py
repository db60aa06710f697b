"""Real vLLM on the GPU machine, carried there in pieces (../shared/reference/vllm-on-the-gpu.md).

The GPU machine has torch 2.11 (CUDA 13) and no network; one machine call carries at most 64 MiB of the tree
and ignored folders. vLLM 0.32.0's CUDA wheel is 311 MiB, most of it compiled code built against torch 2.13's
C++ ABI that cannot load on 2.11 anyway. So:

``pack`` (here, by scripts/fetch-gpu-vllm.sh): unpack the wheel without those files, repack it as tar.xz,
split it and lay the parts and the extra wheels out as ``piece-N`` folders, one per machine call, each small
enough to travel next to the tree. Every piece holds the same MANIFEST (parts, wheels, sha256), so the GPU
side knows when it has them all.

``install`` (there, by scripts/gpu-vllm.sh): copy the carried pieces to DEST (outside the tree: it survives
between calls while the machine stays up), and once all are there reassemble the wheel, ``pip install
--target`` it with the extra wheels, apply the start-up workarounds in that scratch copy only, write the site
files the other scripts read, and check ``import vllm`` with CUDA before anything else.

Standard library only: it runs on both machines before anything is installed."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
VLLM_VERSION = "0.32.0"
MANIFEST = "MANIFEST.json"
ARCHIVE = f"vllm-{VLLM_VERSION}-stripped.tar.xz"
# Compiled against torch 2.13's C++ ABI (fail to load on 2.11) or never used by the engines we run there (the
# Rust frontend binary); __pycache__ is rebuilt there.
STRIPPED = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm/_C_extension.abi3.so",
)
# One call carries 64 MiB in all; the archive is cut in parts of at most 56 MiB so a part and the tree fit.
CALL_LIMIT_MIB = 64.0
PART_LIMIT_MIB = 56.0
# vllm/vllm_flash_attn/__init__.py refuses to import without an FA extension, and vLLM's model inspection
# imports it even when the Triton backend is chosen.
FA_GUARD = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"
FA_GUARD_OFF = "if False:  # pd-operator GPU site: FA extensions not carried (scripts/gpu_vllm.py)"
# What the engines need on that machine: flashinfer is not carried (its sampler must stay off); the attention
# backend and eager mode avoid the FA extensions and CUDA-graph capture time.
SITE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
SITE_VLLM_ARGS = "--attention-backend TRITON_ATTN --enforce-eager"
# The share of each GPU pdctl's engines take together: a tiny model needs little, NIXL registers every KV byte
# (registration time grows with it), and a co-located reference engine or a test may need the rest.
SITE_GPU_MEMORY_FRACTION = "0.3"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------- CPU sid


def strip_wheel(wheel: Path, stage: Path) -> list[str]:
    """Unpack ``wheel`` into ``stage`` without the files that cannot load there; RECORD loses their lines so
    the rebuilt wheel is consistent. Returns what was left out."""
    left_out = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if name in STRIPPED or "/__pycache__/" in f"/{name}":
                left_out.append(name)
                continue
            z.extract(info, stage)
            mode = info.external_attr >> 16
            if mode:
                os.chmod(stage / name, mode & 0o777 or 0o644)
    for record in stage.glob("*.dist-info/RECORD"):
        lines = record.read_text().splitlines()
        record.write_text("".join(f"{line}\n" for line in lines if line.split(",", 1)[0] not in left_out))
    return left_out


def make_archive(wheel: Path, archive: Path) -> None:
    """The stripped wheel's files as tar.xz (xz with threads when the tool exists: several times faster)."""
    with tempfile.TemporaryDirectory(dir=archive.parent) as tmp:
        stage = Path(tmp) / "stage"
        stage.mkdir()
        left_out = strip_wheel(wheel, stage)
        print(f"stripped {len(left_out)} files from {wheel.name}", file=sys.stderr, flush=True)
        partial = archive.with_suffix(".partial")
        if shutil.which("xz") and shutil.which("tar"):
            with partial.open("wb") as out:
                tar = subprocess.Popen(["tar", "-C", str(stage), "-cf", "-", "."], stdout=subprocess.PIPE)
                subprocess.run(["xz", "-6", "-T0", "-c"], stdin=tar.stdout, stdout=out, check=True)
                if tar.wait() != 0:
                    raise RuntimeError("tar failed")
        else:
            with tarfile.open(partial, "w:xz") as tar_file:
                tar_file.add(stage, arcname=".")
        partial.replace(archive)


@dataclass(frozen=True)
class Item:
    """One file a piece carries: an archive part or a wheel."""

    name: str
    size: int


def plan_pieces(parts: list[Item], wheels: list[Item], capacity: int) -> list[list[Item]]:
    """Files per machine call: the archive's parts in order, one per piece, then the wheels packed into the
    pieces' free room (largest first), new pieces only when none has room. Every piece stays within
    ``capacity`` bytes."""
    pieces = [[part] for part in parts]
    for wheel in sorted(wheels, key=lambda item: -item.size):
        if wheel.size > capacity:
            raise ValueError(f"{wheel.name} ({wheel.size / MIB:.1f} MiB) alone exceeds a piece")
        # the last pieces first: the first call also pays the machine's start, keep it lean
        room = [piece for piece in reversed(pieces) if sum(i.size for i in piece) + wheel.size <= capacity]
        if room:
            room[0].append(wheel)
        else:
            pieces.append([wheel])
    return pieces


def split_archive(archive: Path, out_dir: Path, part_bytes: int) -> list[Item]:
    parts = []
    with archive.open("rb") as source:
        index = 1
        while chunk := source.read(part_bytes):
            name = f"{archive.name}.part-{index}"
            (out_dir / name).write_bytes(chunk)
            parts.append(Item(name, len(chunk)))
            index += 1
    return parts


def layout(archive_bytes: int, wheels_dir: Path, tree_bytes: int) -> list[list[Item]]:
    """The pieces an archive of ``archive_bytes`` and the wheels in ``wheels_dir`` make, without writing."""
    capacity = capacity_bytes(tree_bytes)
    part_bytes = min(int(PART_LIMIT_MIB * MIB), capacity)
    count = -(-archive_bytes // part_bytes)
    parts = [
        Item(f"{ARCHIVE}.part-{i + 1}", min(part_bytes, archive_bytes - i * part_bytes)) for i in range(count)
    ]
    wheels = [Item(path.name, path.stat().st_size) for path in sorted(wheels_dir.glob("*.whl"))]
    return plan_pieces(parts, wheels, capacity)


def pack(root: Path, wheel: Path, wheels_dir: Path, tree_bytes: int) -> list[Path]:
    """Lay out ``root``/piece-N; returns the piece folders (rebuilt on every call: cheap next to the
    archive)."""
    build = root / "build"
    build.mkdir(parents=True, exist_ok=True)
    archive = build / ARCHIVE
    stamp = build / "archive-of.txt"  # which wheel the archive was made from: rebuild when it changes
    source = f"{wheel.name} {wheel.stat().st_size}\n"
    if not archive.exists() or not stamp.exists() or stamp.read_text() != source:
        make_archive(wheel, archive)
        stamp.write_text(source)
    capacity = capacity_bytes(tree_bytes)
    part_bytes = min(int(PART_LIMIT_MIB * MIB), capacity)
    for old in [*build.glob(f"{ARCHIVE}.part-*"), *root.glob("piece-*")]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    parts = split_archive(archive, build, part_bytes)
    wheels = [Item(path.name, path.stat().st_size) for path in sorted(wheels_dir.glob("*.whl"))]
    pieces = plan_pieces(parts, wheels, capacity)
    manifest = {
        "vllm_version": VLLM_VERSION,
        "wheel": wheel.name,
        "archive": {"name": archive.name, "sha256": sha256(archive), "size": archive.stat().st_size},
        "pieces": len(pieces),
        "files": {},
    }
    folders = []
    for number, items in enumerate(pieces, start=1):
        folder = root / f"piece-{number}"
        folder.mkdir()
        for item in items:
            source_path = build / item.name if item.name.startswith(ARCHIVE) else wheels_dir / item.name
            os.link(source_path, folder / item.name)  # same disk: no copy
            kind = "part" if item.name.startswith(ARCHIVE) else "wheel"
            manifest["files"][item.name] = {"piece": number, "kind": kind, "size": item.size}
        folders.append(folder)
    text = json.dumps(manifest, indent=1) + "\n"
    for folder in folders:
        (folder / MANIFEST).write_text(text)
    return folders


def capacity_bytes(tree_bytes: int) -> int:
    """What one piece may hold: the call's limit less the tree that travels with it and a margin for the
    tree's growth between packing and the call."""
    return int(CALL_LIMIT_MIB * MIB) - tree_bytes - 2 * MIB


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


# --------------------------------------------------------------------------------------------------- GPU sid


def collect(tree: Path, dest: Path) -> dict[str, object] | None:
    """Copy every carried piece from the tree into ``dest``/pieces; the manifest, or None when none came."""
    store = dest / "pieces"
    store.mkdir(parents=True, exist_ok=True)
    manifest = None
    for folder in sorted((tree / ".gpu-vllm").glob("piece-*")):
        for path in folder.iterdir():
            if path.is_file():
                shutil.copyfile(path, store / f"{path.name}.partial")
                (store / f"{path.name}.partial").replace(store / path.name)
        print(f"copied {folder.name} ({folder_bytes(folder) / MIB:.1f} MiB) to {store}", flush=True)
    if (store / MANIFEST).exists():
        manifest = json.loads((store / MANIFEST).read_text())
    return manifest


def missing_pieces(store: Path, manifest: dict[str, object]) -> list[int]:
    files: dict[str, dict[str, object]] = manifest["files"]  # type: ignore[assignment]
    missing = {
        int(entry["piece"])  # type: ignore[call-overload]
        for name, entry in files.items()
        if not (store / name).exists() or (store / name).stat().st_size != entry["size"]
    }
    return sorted(missing)


def rebuild_wheel(store: Path, manifest: dict[str, object], work: Path) -> Path:
    """The stripped wheel, whole again: parts joined and checked, unpacked, zipped (stored: it is unpacked
    right away)."""
    archive_info: dict[str, object] = manifest["archive"]  # type: ignore[assignment]
    files: dict[str, dict[str, object]] = manifest["files"]  # type: ignore[assignment]
    parts = sorted(
        (n for n, e in files.items() if e["kind"] == "part"), key=lambda n: int(n.rsplit("-", 1)[1])
    )
    archive = work / str(archive_info["name"])
    with archive.open("wb") as out:
        for name in parts:
            with (store / name).open("rb") as part:
                shutil.copyfileobj(part, out, 4 * MIB)
    if sha256(archive) != archive_info["sha256"]:
        raise RuntimeError(f"{archive.name}: sha256 differs from the manifest's (a piece was damaged)")
    unpacked = work / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="tar")
    archive.unlink()
    wheel = work / str(manifest["wheel"])
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path in sorted(unpacked.rglob("*")):
            if path.is_file():
                z.write(path, path.relative_to(unpacked).as_posix())
    shutil.rmtree(unpacked)
    return wheel


def disable_fa_guard(site_packages: Path) -> None:
    init = site_packages / "vllm" / "vllm_flash_attn" / "__init__.py"
    text = init.read_text()
    if FA_GUARD_OFF in text:
        return
    if FA_GUARD not in text:
        raise RuntimeError(f"{init}: the FA import guard changed; review the workaround")
    init.write_text(text.replace(FA_GUARD, FA_GUARD_OFF))


def write_site(dest: Path, site_packages: Path) -> None:
    """site.env (KEY=VALUE, shell-quoted: pdctl reads it as its local site, shells source it) and activate.sh
    (what a shell sources to use this install)."""
    lines = [
        "# The GPU machine's local site, written by scripts/gpu-vllm.sh: engine env and pdctl's settings."
    ]
    settings = {
        **SITE_ENV,
        "PDCTL_VLLM_GPU_ARGS": SITE_VLLM_ARGS,
        "PDCTL_GPU_MEMORY_FRACTION": SITE_GPU_MEMORY_FRACTION,
    }
    lines += [f"{key}={shlex.quote(value)}" for key, value in settings.items()]
    (dest / "site.env").write_text("\n".join(lines) + "\n")
    (dest / "activate.sh").write_text(
        f"# source me: vLLM {VLLM_VERSION} from {site_packages}, the site pdctl reads\n"
        f'export PYTHONPATH={shlex.quote(str(site_packages))}"${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f"export PDCTL_SITE={shlex.quote(str(dest / 'site.env'))}\n"
        f"set -a; . {shlex.quote(str(dest / 'site.env'))}; set +a\n"
    )


CHECK = """
import json, sys
verdict = {}
try:
    import torch
    verdict["torch"] = torch.__version__
    verdict["cuda"] = torch.cuda.is_available()
    verdict["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as error:
    verdict["torch_error"] = f"{type(error).__name__}: {error}"
try:
    import vllm, vllm._C_stable_libtorch  # the compiled ops the engines use
    verdict["vllm"] = vllm.__version__
except Exception as error:
    verdict["vllm_error"] = f"{type(error).__name__}: {error}"
print(json.dumps(verdict))
sys.exit(0 if verdict.get("cuda") and "vllm" in verdict else 1)
"""


def check(site_packages: Path) -> tuple[bool, str]:
    env = {**os.environ, "PYTHONPATH": f"{site_packages}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    lines = done.stdout.strip().splitlines()
    return done.returncode == 0, lines[-1] if lines else done.stderr[-2000:]


def install(tree: Path, dest: Path) -> int:
    manifest = collect(tree, dest)
    store = dest / "pieces"
    if manifest is None:
        print(
            "NOT READY: no piece here yet; carry .gpu-vllm/piece-1 (scripts/fetch-gpu-vllm.sh lists the "
            "calls)"
        )
        return 1
    site_packages = dest / "site-packages"
    installed = dest / "installed.json"
    if installed.exists() and json.loads(installed.read_text()) == manifest["archive"]:
        print(f"vLLM {VLLM_VERSION} already installed in {site_packages}")
    else:
        if missing := missing_pieces(store, manifest):
            have = int(manifest["pieces"]) - len(missing)  # type: ignore[call-overload]
            print(
                f"WAITING: {have} of {manifest['pieces']} pieces in {store}; next carry "
                f".gpu-vllm/piece-{missing[0]}"
            )
            return 0
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            work = Path(tmp)
            wheel = rebuild_wheel(store, manifest, work)
            files: dict[str, dict[str, object]] = manifest["files"]  # type: ignore[assignment]
            wheels = [str(store / n) for n, e in files.items() if e["kind"] == "wheel"]
            target = work / "site-packages"
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            subprocess.run([*pip, "--no-cache-dir", "--target", str(target), str(wheel), *wheels], check=True)
            disable_fa_guard(target)
            shutil.rmtree(site_packages, ignore_errors=True)
            target.replace(site_packages)
        installed.write_text(json.dumps(manifest["archive"]))
    write_site(dest, site_packages)
    ok, verdict = check(site_packages)
    print(f"check: {verdict}")
    if ok:
        print(f"READY: vLLM {VLLM_VERSION} with CUDA; `. {dest / 'activate.sh'}` to use it")
        return 0
    print(f"NOT READY: vLLM {VLLM_VERSION} installed in {site_packages} but the check failed (above)")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="CPU side: strip, archive, split into .gpu-vllm/piece-N")
    packing.add_argument("--root", type=Path, required=True, help="the .gpu-vllm folder")
    packing.add_argument("--wheel", type=Path, required=True, help="vLLM's CUDA wheel")
    packing.add_argument("--wheels", type=Path, required=True, help="folder of the extra wheels")
    packing.add_argument("--tree-bytes", type=int, required=True, help="what the tree adds to every call")
    planning = commands.add_parser("plan", help="CPU side: print the pieces pack would write, write nothing")
    planning.add_argument("--wheels", type=Path, required=True, help="folder of the extra wheels")
    planning.add_argument("--tree-bytes", type=int, required=True, help="what the tree adds to every call")
    planning.add_argument("--archive-bytes", type=int, required=True, help="the stripped tar.xz's size")
    installing = commands.add_parser("install", help="GPU side: collect pieces, install when complete")
    installing.add_argument("--tree", type=Path, required=True, help="the repository root (with .gpu-vllm/)")
    installing.add_argument("--dest", type=Path, required=True, help="scratch folder outside the tree")
    args = parser.parse_args(argv)
    if args.command == "plan":
        for number, items in enumerate(layout(args.archive_bytes, args.wheels, args.tree_bytes), start=1):
            print(f"piece-{number} {sum(item.size for item in items)} {len(items)}")
        return 0
    if args.command == "pack":
        for folder in pack(args.root, args.wheel, args.wheels, args.tree_bytes):
            print(f"{folder.name} {folder_bytes(folder)}")
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    return install(args.tree, args.dest.resolve())


if __name__ == "__main__":
    sys.exit(main())
