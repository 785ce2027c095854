"""Exports in object storage: ``--export s3://bucket/model`` and ``hpsray serve s3://bucket/model``
(any pyarrow.fs URI; docs/export.md). An export is written to a local directory as always, then
uploaded (each ``manifest.json`` after the files it names, so a reader that finds a manifest
finds its files); files of an earlier export there that the new one does not name are deleted
after its manifest. Reading downloads the whole export (deltas included) into a local cache and
returns that directory. One writer per URI.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from hpsray.errors import ExportError
from hpsray.fileio import put_file, replacing

__all__ = ["CACHE_ENV", "fetch_export", "is_uri", "local_files", "upload_export"]

CACHE_ENV = "HPSRAY_EXPORT_CACHE"
MANIFEST = "manifest.json"
_VERSION = ".hpsray-remote-version"  # in a downloaded copy: what it was downloaded from
_CHUNK = 8 << 20


def is_uri(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` names object storage (``scheme://``, not ``file://``)."""
    text = os.fspath(directory)
    return "://" in text and not text.startswith("file://")


def _open(uri: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    try:
        fs, root = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
        raise ExportError(f"{uri.split('?')[0]}: cannot open the store: {e}") from e
    return fs, root.rstrip("/")


def _listing(fs: Any, root: str) -> dict[str, int]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return {i.path[len(root) + 1 :]: int(i.size) for i in infos if i.type == pafs.FileType.File}


def _manifests_last(paths: list[str]) -> list[str]:
    """Files first, then each directory's ``manifest.json``, deepest first (a delta's before
    the base's, so the base's manifest, which readers look for first, comes last)."""
    files = sorted(p for p in paths if os.path.basename(p) != MANIFEST)
    manifests = sorted((p for p in paths if os.path.basename(p) == MANIFEST), key=lambda p: -p.count("/"))
    return files + manifests


def local_files(local: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime_ns)}`` of the export files under ``local``."""
    out = {}
    for p in Path(local).rglob("*"):
        if p.is_file() and p.name != _VERSION:
            st = p.stat()
            out[p.relative_to(local).as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


def upload_export(local: str | os.PathLike, uri: str, unchanged: dict[str, tuple[int, int]] | None = None) -> int:
    """Upload the export directory ``local`` to ``uri`` (see the module docstring); returns the
    bytes sent. ``unchanged``: :func:`local_files` of what was downloaded from ``uri`` before a
    delta was added (those files are not sent again)."""
    fs, root = _open(uri)
    if "/" not in root:
        raise ExportError(f"{uri.split('?')[0]}: give a prefix inside the bucket (s3://bucket/model)")
    fs.create_dir(root.split("/")[0])
    have = _listing(fs, root)
    mine = local_files(local)
    sent = 0
    for rel in _manifests_last(list(mine)):
        if unchanged is not None and unchanged.get(rel) == mine[rel] and rel in have:
            continue
        try:
            sent += put_file(fs, Path(local) / rel, f"{root}/{rel}")
        except OSError as e:
            raise ExportError(f"{uri.split('?')[0]}/{rel}: upload failed: {e}") from e
    for rel in set(have) - set(mine):
        fs.delete_file(f"{root}/{rel}")
    return sent


def default_cache(uri: str) -> Path:
    base = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hpsray" / "exports")
    return base / hashlib.sha256(uri.encode()).hexdigest()[:16]


def fetch_export(uri: str, cache: str | os.PathLike | None = None) -> str:
    """The export at ``uri``, downloaded into ``cache`` (default: ``$HPSRAY_EXPORT_CACHE`` or
    ``~/.cache/hpsray/exports``, then a digest of the URI); returns the local directory. Raises
    :class:`~hpsray.errors.ExportError` when there is no ``manifest.json`` at the URI."""
    fs, root = _open(uri)
    listed = _listing(fs, root)
    if MANIFEST not in listed:
        raise ExportError(f"{uri.split('?')[0]}: no export there (no {MANIFEST})")
    final = Path(cache) if cache is not None else default_cache(uri)
    version = hashlib.sha256(repr(sorted(listed.items())).encode())
    with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
        version.update(f.read())  # a new export id, even at equal sizes
    marker = final / _VERSION
    if marker.is_file() and marker.read_text() == version.hexdigest():
        return str(final)  # unchanged since the last download (a serving watcher looks every few seconds)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{final.name}.tmp-{uuid.uuid4().hex[:8]}", dir=final.parent)
    with replacing(final, tmp) as staging:
        for rel in _manifests_last(list(listed)):
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(f"{root}/{rel}") as src, open(dest, "wb") as out:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
        (staging / _VERSION).write_text(version.hexdigest())
    return str(final)
