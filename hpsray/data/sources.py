"""Where training data comes from: files behind ``pyarrow.fs``, and each reader's share of them.

A source is a path, a glob, a directory or a list of these, on any filesystem pyarrow opens:
local paths, ``file://``, ``s3://`` (pyarrow's S3FileSystem), ``hdfs://`` (pyarrow's
HadoopFileSystem, needs libhdfs and a JVM), ``gs://``, and every other fsspec protocol (for
example ``webhdfs://`` or ``memory://``) wrapped with ``PyFileSystem(FSSpecHandler(fs))``.

:func:`open_source` lists the files once, cuts them into byte-range :class:`Split`\\ s and gives
reader ``i`` of ``n`` a fixed share: the same listing always gives the same shares, the shares
of all readers cover every file exactly once, and each node streams only its own part.
Each format says which files split (:mod:`hpsray.data.formats`): uncompressed line-per-row files
split at line boundaries (a line belongs to the split holding its first byte), Parquet files at
row groups (a row group belongs to the split holding its first byte); compressed files are read
whole.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from hpsray.data.bad_input import UNREADABLE_PATH
from hpsray.data.formats import get_format
from hpsray.data.split import Split
from hpsray.errors import DataError

_GLOB_CHARS = re.compile(r"[*?\[]")
_ARROW_SCHEMES = {"file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss"}
_EXT_CODECS = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2"}
MAX_SPLIT_BYTES = 256 << 20
MIN_SPLIT_BYTES = 1 << 20


def compression_of(path: str, declared: str = "auto") -> str | None:
    """The codec of a file: ``declared`` unless ``"auto"``, else from the extension (or ``None``)."""
    if declared != "auto":
        return None if declared == "none" else declared
    return _EXT_CODECS.get(posixpath.splitext(path)[1].lower())


# -- filesystems ------------------------------------------------------------------------------


def _wrap_fsspec(fs: Any) -> pafs.FileSystem:
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def resolve_filesystem(uri: str, filesystem: Any = None) -> tuple[pafs.FileSystem, str, str]:
    """``(pyarrow filesystem, path inside it, display prefix)`` for a path or URI.

    ``filesystem`` may be a ``pyarrow.fs.FileSystem`` or an fsspec filesystem; then ``uri`` is
    a path in it (a ``scheme://`` prefix is stripped).
    """
    if filesystem is not None:
        if isinstance(filesystem, pafs.FileSystem):
            path = uri.split("://", 1)[1] if "://" in uri else uri
            return filesystem, path, uri[: len(uri) - len(path)]
        strip = getattr(filesystem, "_strip_protocol", None)
        path = strip(uri) if strip else uri
        return _wrap_fsspec(filesystem), path, ""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri)), ""
    scheme = uri.split("://", 1)[0].lower()
    if scheme in _ARROW_SCHEMES:
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (OSError, pa.ArrowException) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            hint = (
                " (pyarrow's HadoopFileSystem needs libhdfs and a JVM; webhdfs:// through fsspec needs neither)"
                if scheme in ("hdfs", "viewfs")
                else ""
            )
            raise DataError(uri, UNREADABLE_PATH, f"cannot open the {scheme}:// filesystem: {first}{hint}") from e
        return fs, path, "" if scheme == "file" else f"{scheme}://"
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec ships with ray[default]
        raise DataError(uri, UNREADABLE_PATH, f"the {scheme}:// protocol needs fsspec") from e
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as e:
        raise DataError(uri, UNREADABLE_PATH, f"no filesystem for {scheme}://: {e}") from e
    # Keep the host in messages (webhdfs://namenode:9870/a/b) when the URI ends with the path.
    prefix = uri[: -len(path)] if path and uri.endswith(path) else f"{scheme}://"
    return _wrap_fsspec(fs), path, prefix


def _glob_regex(pattern: str) -> re.Pattern:
    """``*`` and ``?`` stay within one path component, ``**/`` spans any number of them."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _hidden(rel: str) -> bool:
    """Hidden or metadata entries (``.x``, ``_SUCCESS``, ``_schema.toml``) of a listed directory."""
    return any(part.startswith((".", "_")) for part in rel.split("/") if part)


def list_files(sources: str | Sequence[str], filesystem: Any = None) -> list[Split]:
    """Every file named by ``sources`` (paths, globs, directories), as whole-file splits, sorted.

    A directory stands for all files below it except hidden and ``_``-prefixed ones. A glob
    that matches nothing raises :class:`DataError`; a plain path that does not exist is kept
    with ``size=None`` so that reading it reports ``unreadable_path`` under the bad-input policy.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [os.fspath(sources)]
    if not sources:
        raise DataError(None, UNREADABLE_PATH, "no data source given")
    found: dict[str, Split] = {}
    for src in sources:
        src = os.fspath(src)
        fs, path, prefix = resolve_filesystem(src, filesystem)

        def name(p: str, prefix: str = prefix) -> str:  # this source's prefix
            return prefix + p if prefix else p

        m = _GLOB_CHARS.search(path)
        if m:
            base = path[: m.start()].rsplit("/", 1)[0] if "/" in path[: m.start()] else ""
            regex = _glob_regex(path)
            try:
                infos = fs.get_file_info(pafs.FileSelector(base or ".", recursive=True, allow_not_found=True))
            except (OSError, pa.ArrowException) as e:
                raise DataError(src, UNREADABLE_PATH, f"cannot list {base or '.'}: {e}") from e
            hits = [i for i in infos if i.type == pafs.FileType.File and regex.match(i.path)]
            if not hits:
                raise DataError(src, UNREADABLE_PATH, "no files match this pattern")
            for i in hits:
                found.setdefault(name(i.path), Split(name(i.path), i.path, fs, size=i.size))
            continue
        try:
            info = fs.get_file_info(path)
        except (OSError, pa.ArrowException):
            found.setdefault(name(path), Split(name(path), path, fs, size=None))
            continue
        if info.type == pafs.FileType.Directory:
            try:
                infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            except (OSError, pa.ArrowException) as e:
                raise DataError(src, UNREADABLE_PATH, f"cannot list directory: {e}") from e
            root = path.rstrip("/") + "/"
            files = [i for i in infos if i.type == pafs.FileType.File and not _hidden(i.path[len(root) :])]
            if not files:
                raise DataError(src, UNREADABLE_PATH, "directory holds no data files")
            for i in files:
                found.setdefault(name(i.path), Split(name(i.path), i.path, fs, size=i.size))
        elif info.type == pafs.FileType.File:
            found.setdefault(name(path), Split(name(path), path, fs, size=info.size))
        else:
            found.setdefault(name(path), Split(name(path), path, fs, size=None))
    return [found[k] for k in sorted(found)]


# -- sharding ---------------------------------------------------------------------------------


def plan_splits(
    files: Sequence[Split],
    num_readers: int,
    *,
    split_bytes: int | None = None,
    splittable: Iterable[bool] | None = None,
) -> list[list[Split]]:
    """Cut ``files`` into splits and share them among ``num_readers`` readers, deterministically.

    Splittable files larger than ``split_bytes`` (default: total splittable bytes / readers,
    clamped to [1 MiB, 256 MiB]) are cut into equal byte ranges. Splits go, largest first, to
    the reader with the least bytes so far (ties: lowest index); each reader then reads its
    splits in path order.
    """
    if num_readers < 1:
        raise ValueError(f"num_readers must be >= 1, got {num_readers}")
    flags = list(splittable) if splittable is not None else [True] * len(files)
    if split_bytes is None:
        total = sum(f.size or 0 for f, s in zip(files, flags) if s)
        split_bytes = min(MAX_SPLIT_BYTES, max(MIN_SPLIT_BYTES, -(-total // num_readers)))
    if split_bytes < 1:
        raise ValueError(f"split_bytes must be >= 1, got {split_bytes}")
    units: list[Split] = []
    for f, can_split in zip(files, flags):
        if not can_split or f.size is None or f.size <= split_bytes:
            units.append(f)
            continue
        pieces = -(-f.size // split_bytes)
        bounds = [f.size * k // pieces for k in range(pieces + 1)]
        units += [Split(f.uri, f.path, f.filesystem, lo, hi, f.size) for lo, hi in zip(bounds, bounds[1:])]
    load = [0] * num_readers
    shares: list[list[Split]] = [[] for _ in range(num_readers)]
    for u in sorted(units, key=lambda u: (-u.nbytes, u.uri, u.start)):
        r = min(range(num_readers), key=lambda i: (load[i], i))
        shares[r].append(u)
        load[r] += u.nbytes
    return [sorted(s, key=lambda u: (u.uri, u.start)) for s in shares]


def open_source(
    sources: str | Sequence[str],
    reader_index: int = 0,
    num_readers: int = 1,
    *,
    format: str = "csv",
    compression: str = "auto",
    filesystem: Any = None,
    split_bytes: int | None = None,
) -> list[Split]:
    """The splits that reader ``reader_index`` of ``num_readers`` reads (see :func:`plan_splits`).

    ``format`` and ``compression`` (as in :class:`~hpsray.data.schema.Schema`) decide which files
    can be split (:meth:`hpsray.data.formats.Format.splits`).
    """
    if not 0 <= reader_index < num_readers:
        raise ValueError(f"reader_index must lie in [0, {num_readers}), got {reader_index}")
    files = list_files(sources, filesystem)
    fmt = get_format(format)
    splittable = [fmt.splits(f.path, compression) for f in files]
    return plan_splits(files, num_readers, split_bytes=split_bytes, splittable=splittable)[reader_index]


# -- byte streams -----------------------------------------------------------------------------


class _NativeFileStream(io.RawIOBase):
    """A readable raw stream over a pyarrow ``NativeFile`` ``self._f``; subclasses define ``read``."""

    _f: pa.NativeFile

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:  # a writable buffer
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


class RangeStream(_NativeFileStream):
    """A read-only stream over ``[start, end)`` of a pyarrow random-access file."""

    def __init__(self, f: pa.NativeFile, start: int, end: int) -> None:
        super().__init__()
        self._f = f
        self._pos = start
        self._end = end

    def read(self, n: int = -1) -> bytes:
        left = self._end - self._pos
        if n is None or n < 0 or n > left:
            n = left
        if n <= 0:
            return b""
        data = self._f.read_at(n, self._pos)
        self._pos += len(data)
        return data


class WholeLineStream(_NativeFileStream):
    """A decompressing stream that hands out whole lines only and turns a read error into EOF.

    A truncated or corrupt gzip/zstd file fails somewhere mid-line. Holding back the bytes after
    the last newline means the parser never sees the partial line (which could parse as a valid,
    wrong row); the error is kept in ``error`` for the caller to report, and every complete line
    before it is still read (pyarrow's reader would otherwise lose its read-ahead blocks).
    """

    def __init__(self, f: pa.NativeFile) -> None:
        super().__init__()
        self._f = f
        self._tail = b""
        self._eof = False
        self.error: BaseException | None = None

    def read(self, n: int = -1) -> bytes:
        while not self._eof:
            try:
                data = self._f.read(n if n and n > 0 else 1 << 20)
            except (OSError, pa.ArrowException) as e:
                self.error = e
                self._eof = True
                self._tail = b""  # the partial line before the damage is dropped
                return b""
            if not data:
                self._eof = True
                break
            cut = data.rfind(b"\n")
            if cut < 0:
                self._tail += data
                continue
            out = self._tail + data[: cut + 1]
            self._tail = data[cut + 1 :]
            return out
        out, self._tail = self._tail, b""
        return out


def next_line_start(f: pa.NativeFile, pos: int, size: int, chunk: int = 1 << 16) -> int:
    """The offset just after the first ``\\n`` at or after ``pos`` (``size`` if there is none)."""
    while pos < size:
        data = f.read_at(min(chunk, size - pos), pos)
        if not data:
            break
        i = data.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(data)
    return size


def open_lines(split: Split, compression: str) -> tuple[RangeStream | WholeLineStream, int, bool]:
    """A stream over the whole lines of ``split``: ``(stream, offset of its first line, no line
    starts in the split)``. Uncompressed: the lines whose first byte lies in the byte range;
    compressed (``compression`` as in the schema): the whole file, which must be one split."""
    codec = compression_of(split.path, compression)
    fs = split.filesystem
    if codec:
        if not split.whole:
            raise ValueError(f"{split.uri}: a compressed file cannot be read in byte ranges")
        return WholeLineStream(fs.open_input_stream(split.path, compression=codec)), 0, False
    f = fs.open_input_file(split.path)
    size = f.size()
    start = 0 if split.start == 0 else next_line_start(f, split.start - 1, size)
    end = size if split.end is None or split.end >= size else next_line_start(f, split.end - 1, size)
    return RangeStream(f, start, max(start, end)), start, end <= start


def count_lines_before(split: Split, offset: int, chunk: int = 1 << 22) -> int:
    """Newlines in ``[0, offset)`` of an uncompressed file: the line number base of a split."""
    n = 0
    with split.filesystem.open_input_file(split.path) as f:
        pos = 0
        while pos < offset:
            data = f.read_at(min(chunk, offset - pos), pos)
            if not data:
                break
            n += data.count(b"\n")
            pos += len(data)
    return n
