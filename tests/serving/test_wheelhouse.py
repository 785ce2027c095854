"""benchmarks/gpu_wheelhouse.py: wheels cut into parts that fit the device tool's carry, joined back exactly."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_wheelhouse.py"
_spec = importlib.util.spec_from_file_location("_hpsray_gpu_wheelhouse", SCRIPT)
wh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wh)

MIB = 1 << 20


def _wheels(d: Path) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    sizes = {"ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl": int(5.3 * MIB), "orjson-3.11-py3-none-any.whl": 300_000}
    sizes["aiohttp-3.14-cp312-cp312-manylinux2014_x86_64.whl"] = int(1.7 * MIB)
    d.mkdir()
    out = {}
    for name, n in sizes.items():
        out[name] = rng.bytes(n)
        (d / name).write_bytes(out[name])
    return out


def test_parts_fit_the_limit_and_join_back_byte_for_byte(tmp_path):
    want = _wheels(tmp_path / "dl")
    parts = wh.pack(tmp_path / "dl", tmp_path / "wh", 2 * MIB)
    assert len(parts) >= 4  # 5.3 MiB of one wheel alone needs three parts of 2 MiB
    for p in parts:
        assert sum(f.stat().st_size for f in p.iterdir() if f.name != "manifest.json") <= 2 * MIB
    got = wh.unpack(tmp_path / "wh", tmp_path / "joined")
    assert {w.name: w.read_bytes() for w in got} == want


def test_a_missing_part_or_a_damaged_piece_is_named(tmp_path):
    _wheels(tmp_path / "dl")
    parts = wh.pack(tmp_path / "dl", tmp_path / "wh", 2 * MIB)
    ray_part = next(p for p in parts if any(f.name.startswith("ray-") and ".part" in f.name for f in p.iterdir()))
    moved = tmp_path / "elsewhere"
    shutil.move(str(ray_part), moved)
    with pytest.raises(SystemExit, match="ray-2.60.0.*carry the rest"):
        wh.unpack(tmp_path / "wh", tmp_path / "joined")
    shutil.move(str(moved), ray_part)
    piece = next(f for f in ray_part.iterdir() if f.name != "manifest.json")
    data = bytearray(piece.read_bytes())
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="SHA-256"):
        wh.unpack(tmp_path / "wh", tmp_path / "joined2")
    with pytest.raises(SystemExit, match="no carry-N parts"):
        wh.unpack(tmp_path / "empty", tmp_path / "joined3")


def test_packages_the_gpu_machine_has_are_not_packed():
    have = [h.lower() for h in wh.HAVE]
    assert wh._dropped(wh._name("nvidia_cublas_cu12-12.9-py3-none-manylinux_2_27_x86_64.whl"), have)
    assert wh._dropped(wh._name("torch-2.9.0-cp312-cp312-manylinux_2_28_x86_64.whl"), have)
    assert not wh._dropped(wh._name("ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"), have)


def test_stash_keeps_each_carried_part_for_the_next_call(tmp_path):
    """On the GPU machine each call carries one part into the tree; ``stash`` copies it out to a
    folder that outlives the call, and once every part is there they join back exactly."""
    want = _wheels(tmp_path / "dl")
    parts = wh.pack(tmp_path / "dl", tmp_path / "built", 2 * MIB)
    keep = tmp_path / "keep"
    for i, part in enumerate(parts):  # one call per part: the tree holds only that part
        tree = tmp_path / f"call{i}" / "build" / "gpu-wheelhouse"
        shutil.copytree(part, tree / part.name)
        assert [p.name for p in wh.stash(tree, keep)] == sorted(p.name for p in parts[: i + 1])
        if i < len(parts) - 1:
            with pytest.raises(SystemExit, match="carry the rest"):
                wh.unpack(keep, tmp_path / f"early{i}")
    got = wh.unpack(keep, tmp_path / "joined")
    assert {w.name: w.read_bytes() for w in got} == want
