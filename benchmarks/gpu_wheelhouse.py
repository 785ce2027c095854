"""A wheelhouse of what an offline GPU machine lacks to run ``hpsray bench serve --device cuda``, in carriable parts.

The GPU machines at hand have torch, CuPy, numba-cuda and pyarrow but no Ray, and no network;
what reaches them travels with one ``run`` call of the device tool, at most 64 MiB with the
working tree (~3 MiB), while Ray's wheel alone is ~79 MB. So, on a machine with an index::

    python benchmarks/gpu_wheelhouse.py build [--out build/gpu-wheelhouse] [--python-version 3.12] [--cuda 13]

downloads the wheels of the serving stack for the GPU machine's Python and platform (``ray[serve,
default]``, rocksdict, aiohttp, orjson, fsspec, matplotlib, tqdm, pytest; with their
dependencies; kvikio without its own), drops those the machine already has (``--have``: torch,
numpy, pyarrow, CuPy, numba, nvidia-*), cuts every wheel larger than ``--part-mib`` (default 56)
into byte pieces, and packs wheels and pieces into ``OUT/carry-1``, ``OUT/carry-2`` ... of at most
``--part-mib`` each, every part with a ``manifest.json`` (each wheel's size and SHA-256, its
pieces; how many parts there are). ``build/`` is git-ignored: a part travels only as the
``carry`` of a call, one part per call. The device machine's disk lasts only while it is
warm (it is given back about 30 s after a call ends), so the parts must go over in consecutive
calls, each started as soon as the one before returns, and each call copies its part out of the
tree into a folder that outlives the call (the tree's ignored paths are replaced by the next
call's carry)::

    run(carry=["build/gpu-wheelhouse/carry-1"], command="python3 benchmarks/gpu_wheelhouse.py stash")
    run(carry=["build/gpu-wheelhouse/carry-2"], command="python3 benchmarks/gpu_wheelhouse.py stash")
    run(carry=["build/gpu-wheelhouse/carry-3"], command="benchmarks/gpu_check_ray")  # stashes, installs, runs

``stash [--from build/gpu-wheelhouse] [--into /tmp/hpsray-wheelhouse]`` copies the parts found in
the tree into ``--into``. ``install [--out /tmp/hpsray-wheelhouse] [--target OUT/site]`` joins the
pieces, checks every wheel's size and SHA-256 (a missing part or a damaged piece is an error
naming it) and installs the wheels with ``pip install --no-index --no-deps --target``: a folder
to put first on ``PYTHONPATH`` (torch, CuPy and numba-cuda stay the machine's own; a virtual
environment made from that machine's Python, itself a venv, would not see them). It prints the
``PYTHONPATH`` to use; hpsray runs from the working tree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

CARRY_LIMIT_MIB = 64
STASH = "/tmp/hpsray-wheelhouse"
"""Where the parts wait on the GPU machine between calls (its disk, while the machine stays warm)."""
REQUIREMENTS = [
    "ray[serve,default]>=2.60,<3",
    "rocksdict>=0.3",
    "aiohttp>=3.9",
    "orjson>=3.8",
    "fsspec>=2023.1",
    "matplotlib>=3.7",
    "tqdm>=4.66",
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",
]
KVIKIO = {"12": ["kvikio-cu12>=24.10", "libkvikio-cu12>=24.10"], "13": ["kvikio-cu13>=25.10", "libkvikio-cu13>=25.10"]}
"""Downloaded without their dependencies (CuPy and the CUDA libraries, which the machine has) and
installed with ``--no-deps``; a kvikio that does not install leaves the bench on its ``preadv`` path."""
HAVE = ("torch", "numpy", "pyarrow", "cupy-*", "numba", "numba-cuda", "llvmlite", "nvidia-*", "fastrlock")


def _name(wheel: str) -> str:
    """The normalised project name of a wheel file (``Ray-2.60.0-...whl`` -> ``ray``)."""
    return re.sub(r"[-_.]+", "-", wheel.split("-", 1)[0]).lower()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dropped(name: str, have: list[str]) -> bool:
    return any(name == h or (h.endswith("*") and name.startswith(h[:-1])) for h in have)


def pack(wheels: Path, out: Path, part_bytes: int) -> list[Path]:
    """Cut the wheels of ``wheels`` into pieces of at most ``part_bytes`` and pack them into
    ``out/carry-N`` directories of at most ``part_bytes`` each (first fit, largest first); returns
    the part directories. Each holds ``manifest.json``: ``{"wheels": {file: {"bytes", "sha256",
    "pieces": [piece, ...]}}}`` for the wheels whose pieces it holds (pieces in order)."""
    if part_bytes < 1 << 20:
        raise ValueError(f"part_bytes must be at least 1 MiB, got {part_bytes}")
    items: list[tuple[int, str, str, int, int]] = []  # (size, wheel, piece name, start, length)
    meta: dict[str, dict] = {}
    for w in sorted(wheels.glob("*.whl")):
        size = w.stat().st_size
        n = max(1, -(-size // part_bytes))
        pieces = [w.name] if n == 1 else [f"{w.name}.part{i:02d}" for i in range(n)]
        meta[w.name] = {"bytes": size, "sha256": _sha256(w), "pieces": pieces}
        step = -(-size // n)
        for i, p in enumerate(pieces):
            start = i * step
            items.append((min(step, size - start), w.name, p, start, min(step, size - start)))
    bins: list[list[tuple[int, str, str, int, int]]] = []
    room: list[int] = []
    for item in sorted(items, key=lambda t: -t[0]):
        for b, left in enumerate(room):
            if item[0] <= left:
                bins[b].append(item)
                room[b] -= item[0]
                break
        else:
            bins.append([item])
            room.append(part_bytes - item[0])
    parts = []
    for b, content in enumerate(bins, 1):
        part = out / f"carry-{b}"
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        manifest: dict[str, dict] = {}
        for _, wheel, piece, start, length in content:
            with open(wheels / wheel, "rb") as src, open(part / piece, "wb") as dst:
                src.seek(start)
                dst.write(src.read(length))
            manifest[wheel] = meta[wheel]
        doc = {"wheels": manifest, "part": b, "parts": len(bins)}
        (part / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
        parts.append(part)
    return parts


def unpack(out: Path, wheels: Path) -> list[Path]:
    """Join the pieces found in ``out/carry-*`` into whole wheels in ``wheels``, each checked
    against its size and SHA-256; returns the wheels. Raises ``SystemExit`` naming what is missing
    or damaged."""
    parts = sorted(out.glob("carry-*"), key=lambda p: int(p.name.split("-")[1]))
    if not parts:
        raise SystemExit(f"{out}: no carry-N parts here; carry them first (see the docstring)")
    where: dict[str, Path] = {}
    meta: dict[str, dict] = {}
    total = 0
    for part in parts:
        doc = json.loads((part / "manifest.json").read_text())
        meta.update(doc["wheels"])
        total = max(total, int(doc.get("parts", 0)))
        for f in part.iterdir():
            if f.name != "manifest.json":
                where[f.name] = f
    for wheel, info in sorted(meta.items()):
        missing = [p for p in info["pieces"] if p not in where]
        if missing:
            raise SystemExit(f"{wheel}: pieces {missing} are in none of {[p.name for p in parts]}: carry the rest")
    missing_parts = sorted({f"carry-{i}" for i in range(1, total + 1)} - {p.name for p in parts})
    if missing_parts:
        raise SystemExit(f"{out}: parts {missing_parts} of {total} are missing: carry the rest")
    wheels.mkdir(parents=True, exist_ok=True)
    done = []
    for wheel, info in sorted(meta.items()):
        target = wheels / wheel
        with open(target, "wb") as dst:
            for p in info["pieces"]:
                dst.write(where[p].read_bytes())
        if target.stat().st_size != info["bytes"] or _sha256(target) != info["sha256"]:
            target.unlink()
            raise SystemExit(f"{wheel}: joined wheel does not match its SHA-256 (a damaged piece)")
        done.append(target)
    return done


def stash(source: Path, into: Path) -> list[Path]:
    """Copy the ``carry-N`` parts found under ``source`` into ``into`` (replacing a part of the same
    number); returns the parts now in ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for part in sorted(source.glob("carry-*")):
        if (part / "manifest.json").exists():
            shutil.rmtree(into / part.name, ignore_errors=True)
            shutil.copytree(part, into / part.name)
    return sorted(into.glob("carry-*"))


def build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    dl = out / "download"
    shutil.rmtree(dl, ignore_errors=True)
    dl.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "-d", str(dl)]
    cmd += ["--python-version", args.python_version, "--implementation", "cp"]
    for plat in args.platform:
        cmd += ["--platform", plat]
    subprocess.run(cmd + REQUIREMENTS, check=True)
    if args.cuda:
        subprocess.run(cmd + ["--no-deps", *KVIKIO[args.cuda]], check=True)
    have = [h.strip().lower() for h in args.have.split(",") if h.strip()]
    for w in dl.glob("*.whl"):
        if _dropped(_name(w.name), have):
            w.unlink()
    parts = pack(dl, out, int(args.part_mib * (1 << 20)))
    shutil.rmtree(dl)
    total = sum(f.stat().st_size for p in parts for f in p.iterdir())
    print(f"{len(parts)} parts, {total / 2**20:.1f} MiB in all, each carried by one call:")
    for p in parts:
        size = sum(f.stat().st_size for f in p.iterdir()) / 2**20
        print(f"  {p} ({size:.1f} MiB)")
    print("then one call per part, at once one after the other (the machine keeps its disk only while warm):")
    for p in parts[:-1]:
        print(f'  run(carry=["{p}"], command="python3 benchmarks/gpu_wheelhouse.py stash --from {out}")')
    print(f'  run(carry=["{parts[-1]}"], command="python3 benchmarks/gpu_check_ray", timeout_s=600)')
    return 0


def install(args: argparse.Namespace) -> int:
    out = Path(args.out)
    wheels = unpack(out, out / "wheels")
    target = Path(args.target or out / "site")
    kvikio = [w for w in wheels if "kvikio" in _name(w.name)]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    pip += ["--target", str(target)]
    subprocess.run(pip + [str(w) for w in wheels if w not in kvikio], check=True)
    if kvikio and subprocess.run(pip + [str(w) for w in kvikio]).returncode != 0:
        print("kvikio did not install: the GPU paths read SSD misses by parallel preadv", file=sys.stderr)
    print(f"installed {len(wheels)} wheels into {target}; run with PYTHONPATH={target}:{os.getcwd()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download and pack (on a machine with an index)")
    b.add_argument("--out", default="build/gpu-wheelhouse")
    b.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    b.add_argument(
        "--platform",
        action="append",
        default=None,
        help="wheel platform tags of the GPU machine (repeatable; default manylinux 2.17-2.28 x86_64)",
    )
    b.add_argument("--cuda", choices=("", "12", "13"), default="12", help="kvikio for CUDA 12 or 13 ('' : none)")
    b.add_argument("--have", default=",".join(HAVE), help="packages the GPU machine has: not packed")
    b.add_argument(
        "--part-mib", type=float, default=56.0, help=f"largest part (at most {CARRY_LIMIT_MIB} MiB with the tree)"
    )
    st = sub.add_parser("stash", help="copy the carried parts out of the tree (on the GPU machine)")
    st.add_argument("--from", dest="source", default="build/gpu-wheelhouse")
    st.add_argument("--into", default=STASH)
    i = sub.add_parser("install", help="join, check and install (on the GPU machine, offline)")
    i.add_argument("--out", default=STASH, help="the folder holding the carry-N parts")
    i.add_argument("--target", help="install into this folder (default OUT/site), for PYTHONPATH")
    args = parser.parse_args(argv)
    if args.command == "stash":
        parts = stash(Path(args.source), Path(args.into))
        print(f"{args.into}: {', '.join(p.name for p in parts) or 'no parts'}")
        return 0
    if args.command == "build":
        if not 1 <= args.part_mib <= CARRY_LIMIT_MIB:
            parser.error(f"--part-mib must lie in 1..{CARRY_LIMIT_MIB}")
        args.platform = args.platform or [f"manylinux_2_{v}_x86_64" for v in (28, 27, 26, 24, 17)] + [
            "manylinux2014_x86_64"
        ]
        return build(args)
    return install(args)


if __name__ == "__main__":
    sys.exit(main())
