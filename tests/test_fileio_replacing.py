"""``fileio.replacing``: a staging directory replaces the final one whole, or is removed."""

from __future__ import annotations

import pytest

from hpsray.fileio import replacing


def test_a_filled_staging_directory_replaces_the_final_one_whole(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "old").write_text("old")
    with replacing(final, tmp_path / ".final.tmp") as staging:
        staging.mkdir()
        (staging / "new").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert not (tmp_path / ".final.tmp").exists()


def test_a_failure_while_filling_leaves_the_final_directory_as_it_was(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "old").write_text("old")
    with pytest.raises(RuntimeError, match="download failed"), replacing(final, tmp_path / ".final.tmp") as staging:
        staging.mkdir()
        (staging / "half").write_text("half")
        raise RuntimeError("download failed")
    assert sorted(p.name for p in final.iterdir()) == ["old"]
    assert not (tmp_path / ".final.tmp").exists()
