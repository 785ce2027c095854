"""Checkpoints in object storage: ``[checkpoint] dir = "s3://bucket/prefix"`` (any pyarrow.fs
URI; docs/architecture.md: Checkpoints).

A checkpoint is staged and sealed in a local cache directory exactly as
:class:`~hpsray.checkpoint.checkpoints.Checkpoints` does (same record, same checks), then
uploaded under ``URI``::

    params/<sha256 of the header>-<size>.hps   an SSD-PS parameter file: immutable, so uploaded
                                               once and referenced by every later checkpoint
    data/ckpt-000120/<path>                    the checkpoint's other files (small)
    ckpt-000120.json                           the manifest: the record and every file's object,
                                               written last: its presence commits the checkpoint

Keeping: after a commit, manifests beyond the ``keep`` newest (and of later batches: an
abandoned run's) are deleted, then every object no kept manifest references (reference count
zero). Resuming (:meth:`RemoteCheckpoints.latest`) downloads the newest manifest that verifies
into the cache, so a host whose disks are empty resumes. One writer per URI.

Several hosts: each node uploads its own files from its host (:func:`upload_node`), the driver
commits with what they sent (``commit(uploaded=...)``), and a resume brings each node's files
onto its host (:func:`fetch_node`, from :meth:`RemoteCheckpoints.shard_plan`). No Ray inside.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpsray.checkpoint.checkpoints import Checkpoint, Checkpoints, node_dir
from hpsray.checkpoint.record import NAME, describe_files, read_record
from hpsray.errors import CheckpointError
from hpsray.fileio import put_file, replacing
from hpsray.tiers.ssd.paramfile import HEADER_BYTES

__all__ = ["ObjectStore", "RemoteCheckpoints", "fetch_node", "is_uri", "open_checkpoints", "upload_node"]

log = logging.getLogger("hpsray.checkpoint")

MANIFEST_FORMAT = "hpsray-remote-checkpoint"
_MANIFEST = re.compile(r"ckpt-(\d{6,})\.json")
_CHUNK = 8 << 20
CACHE_ENV = "HPSRAY_CHECKPOINT_CACHE"


def is_uri(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` names object storage (``scheme://``, not ``file://``)."""
    text = str(directory)
    return "://" in text and not text.startswith("file://")


def open_checkpoints(directory: str | os.PathLike, keep: int = 2) -> Checkpoints:
    """The checkpoints at ``directory``: a local directory, or a URI (:class:`RemoteCheckpoints`)."""
    return RemoteCheckpoints(str(directory), keep) if is_uri(directory) else Checkpoints(directory, keep)


def shown(uri: str) -> str:
    """``uri`` as messages name it: without its options (``?...``) and credentials (``key:secret@``)."""
    return re.sub(r"^([A-Za-z][\w+.-]*://)[^/@]*@", r"\1", uri.split("?")[0])


def default_cache(uri: str) -> Path:
    """The local cache of ``uri``'s checkpoints: ``$HPSRAY_CHECKPOINT_CACHE`` or
    ``~/.cache/hpsray/checkpoints``, then a digest of the URI."""
    base = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hpsray" / "checkpoints")
    return base / hashlib.sha256(uri.encode()).hexdigest()[:16]


def _param_key(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)  # its checksums (index, rows, block table) and file number
    return f"params/{hashlib.sha256(head).hexdigest()[:40]}-{size}.hps"


class _StoreIO:
    """Reading and writing objects under ``root`` of the ``pyarrow.fs`` file system ``fs``."""

    uri: str
    fs: Any
    root: str

    def _key(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _exists(self, key: str) -> int | None:
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self._key(key))
        return int(info.size) if info.type == pafs.FileType.File else None

    def _list(self, prefix: str = "") -> dict[str, int]:
        import pyarrow.fs as pafs

        base = self._key(prefix).rstrip("/")
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except FileNotFoundError:
            return {}
        return {i.path[len(self.root) + 1 :]: int(i.size) for i in infos if i.type == pafs.FileType.File}

    def _put(self, local: Path, key: str) -> int:
        try:
            return put_file(self.fs, local, self._key(key))
        except OSError as e:
            raise CheckpointError(f"{self.uri}/{key}", f"upload of {local} failed: {e}") from e

    def _put_bytes(self, data: bytes, key: str) -> None:
        with self.fs.open_output_stream(self._key(key)) as out:
            out.write(data)

    def _get(self, key: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open_input_stream(self._key(key)) as src, open(local, "wb") as out:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())

    def _manifests(self) -> list[tuple[int, str]]:
        """``(batch, key)`` of every manifest, newest first."""
        found = []
        for key in self._list(""):
            m = _MANIFEST.fullmatch(key)
            if m is not None:
                found.append((int(m.group(1)), key))
        return sorted(found, reverse=True)

    def _manifest(self, key: str) -> dict:
        try:
            with self.fs.open_input_stream(self._key(key)) as f:
                manifest = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.uri}/{key}", f"unreadable manifest: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise CheckpointError(f"{self.uri}/{key}", "not an hpsray checkpoint manifest")
        return manifest


class ObjectStore(_StoreIO):
    """The objects under a URI (``filesystem``: as :class:`RemoteCheckpoints`'s)."""

    def __init__(self, uri: str, filesystem: Any = None) -> None:
        self.fs, self.root = _open(uri, filesystem)
        self.uri = shown(uri)


def _open(uri: str, filesystem: Any) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    if filesystem is not None:
        return filesystem, uri.rstrip("/")
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
        raise CheckpointError(shown(uri), f"cannot open the checkpoint store: {e}") from e
    return fs, root.rstrip("/")


def _upload(
    store: _StoreIO, root: Path, entries: Sequence[Mapping[str, Any]], name: str, have: dict[str, int]
) -> tuple[dict[str, str], dict[str, int]]:
    """Upload the recorded files ``entries`` (paths under ``root``) of checkpoint ``name``: a
    parameter file unless ``have`` (the store's ``params/``) holds its key, every other file
    under ``data/<name>/``. Returns ``({path: key}, {"bytes", "files", "reused", "reused_bytes"})``."""
    objects: dict[str, str] = {}
    stats = {"bytes": 0, "files": 0, "reused": 0, "reused_bytes": 0}
    for entry in entries:
        rel, size = str(entry["path"]), int(entry["size"])
        local = root / rel
        if entry.get("check") == "param":
            key = _param_key(local, size)
            if have.get(key) == size:
                stats["reused"] += 1
                stats["reused_bytes"] += size
            else:
                stats["bytes"] += store._put(local, key)
                stats["files"] += 1
                have[key] = size
        else:
            key = f"data/{name}/{rel}"
            stats["bytes"] += store._put(local, key)
            stats["files"] += 1
        objects[rel] = key
    return objects, stats


HOST_MARK = ".driver-host"  # in a staging directory: the driver's token, seen by nodes on its host


def upload_node(location: str, staging: str | os.PathLike, node: int, token: str | None = None) -> dict:
    """Upload node ``node``'s files of a staged checkpoint (``node_dir(staging, node)`` on the
    calling host; the staging directory's name gives the checkpoint's) to the store at
    ``location`` (the URI with its options): each parameter file the store lacks, named by its
    digest, and the node's other files under ``data/<checkpoint>/``. Returns what
    :meth:`RemoteCheckpoints.commit` takes in ``uploaded``: ``{"node", "entries"`` (the record's
    entries of these files), ``"objects"``, ``"sent"`` (bytes, files, reused, reused_bytes)}.

    When the staging directory's :data:`HOST_MARK` does not hold ``token`` (it is the driver's
    directory on another host), the node's copy is removed after the upload: this host keeps
    nothing of the checkpoint."""
    m = re.fullmatch(r"\.(ckpt-\d{6,})\.tmp-[0-9a-f]+", Path(staging).name)
    if m is None:
        raise CheckpointError(str(staging), "not a checkpoint staging directory")
    mine = node_dir(staging, node)
    store = ObjectStore(location)
    prefix = f"{mine.name}/"
    entries = [{**e, "path": prefix + e["path"]} for e in describe_files(str(mine))]
    objects, sent = _upload(store, Path(staging), entries, m.group(1), store._list("params/"))
    try:
        here = (Path(staging) / HOST_MARK).read_text() == token
    except OSError:
        here = False
    if token is not None and not here:
        shutil.rmtree(mine, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(staging)  # when no other node of this host is still in it
    return {"node": int(node), "entries": entries, "objects": objects, "sent": sent}


def fetch_node(plan: Mapping[str, Any], node: int) -> dict[str, int]:
    """Bring node ``node``'s files of a checkpoint (:meth:`RemoteCheckpoints.shard_plan`) onto the
    calling host, at the plan's path: each one not there with its recorded size is downloaded
    (to a temporary name, then renamed). Returns ``{"bytes", "files"}`` downloaded."""
    store = ObjectStore(str(plan["location"]))
    root, prefix = Path(plan["path"]), f"{node_dir('', node).name}/"
    got = {"bytes": 0, "files": 0}
    for rel, key in sorted(plan["objects"].items()):
        if not rel.startswith(prefix):
            continue
        local, size = root / rel, int(plan["sizes"][rel])
        if local.is_file() and local.stat().st_size == size:
            continue
        part = local.with_name(f".{local.name}.part-{uuid.uuid4().hex}")
        try:
            store._get(key, part)
            if part.stat().st_size != size:
                raise CheckpointError(f"{store.uri}/{key}", f"{part.stat().st_size} bytes, {rel} recorded {size}")
            os.replace(part, local)
        finally:
            part.unlink(missing_ok=True)
        got["bytes"] += size
        got["files"] += 1
    return got


class RemoteCheckpoints(Checkpoints, _StoreIO):
    """The checkpoints under ``uri`` (see the module docstring), staged in ``cache`` (default
    :func:`default_cache`); the :class:`Checkpoints` interface. ``filesystem``: a
    ``pyarrow.fs.FileSystem`` to use instead of the URI's (then ``uri`` is its path).

    ``last_upload`` says what the newest commit sent: ``{"bytes", "files", "reused",
    "reused_bytes"}``.
    """

    durable = True  # a copy away from the job's disks

    def __init__(self, uri: str, keep: int = 2, cache: str | os.PathLike | None = None, filesystem: Any = None) -> None:
        self.fs, self.root = _open(uri, filesystem)
        self.uri, self.location = shown(uri), uri
        super().__init__(cache or default_cache(uri), keep)
        self.last_upload: dict = {}

    def __repr__(self) -> str:
        return f"RemoteCheckpoints({self.uri!r}, keep={self.keep}, cache={str(self.directory)!r})"

    # -- Checkpoints' interface --------------------------------------------------------------

    def committed(self) -> list[Path]:
        """Every committed checkpoint's name (as a path under the URI), newest first."""
        return [Path(self.uri) / key[: -len(".json")] for _, key in self._manifests()]

    def fingerprint_of(self, path: Path) -> str | None:
        """The job fingerprint in the manifest of ``path`` (one of :meth:`committed`)."""
        try:
            return json.loads(self._manifest(f"{Path(path).name}.json")["record"]).get("fingerprint")
        except (CheckpointError, ValueError, KeyError):
            return None

    def commit(
        self,
        staging: str | os.PathLike,
        batch: int,
        meta: Any = None,
        *,
        fingerprint: str | None = None,
        elsewhere: Sequence[Mapping[str, Any]] = (),
        uploaded: Sequence[Mapping[str, Any]] = (),
    ) -> Checkpoint:
        """Seal ``staging`` locally (:meth:`Checkpoints.commit`), upload what the store lacks,
        write the manifest (the commit), then delete what no kept manifest references.

        ``uploaded``: what each node's :func:`upload_node` returned; those nodes' files are in
        the store already, and the record lists them also where their directory is not under
        ``staging`` (on another host). Every other node's directory must be under ``staging``."""
        self._refuse_foreign_remote(fingerprint)
        there = {key[: -len(".json")] for _, key in self._manifests()}
        for path in self._local_dirs():  # the cache follows the store (its checkpoints removed there)
            if path.name not in there:
                shutil.rmtree(path, ignore_errors=True)
        done = {int(u["node"]): u for u in uploaded}
        nodes = int(dict(meta or {}).get("nodes", 0))
        absent = [i for i in range(nodes) if i not in done and not node_dir(staging, i).is_dir()]
        if absent:
            self.abort(staging)
            raise CheckpointError(
                f"{staging}",
                f"node {absent[0]}'s files are neither uploaded by that node nor on the driver's host: a "
                f"checkpoint to {self.uri} takes each node's files from upload_node() on its host, or from "
                "the staging directory",
            )
        away = [e for i, u in done.items() if not node_dir(staging, i).is_dir() for e in u["entries"]]
        ckpt = super().commit(staging, batch, meta, fingerprint=fingerprint, elsewhere=[*elsewhere, *away])
        name = ckpt.path.name
        objects = {rel: key for u in done.values() for rel, key in u["objects"].items()}
        mine = [e for e in ckpt.files if e["path"] not in objects]
        sent, driver = _upload(self, ckpt.path, mine, name, self._list("params/"))
        objects.update(sent)
        record = (ckpt.path / NAME).read_text()
        manifest = {"format": MANIFEST_FORMAT, "version": 1, "batch": int(batch), "record": record, "objects": objects}
        self._put_bytes(json.dumps(manifest, sort_keys=True).encode(), f"{name}.json")  # the commit
        parts = [driver, *(u["sent"] for u in done.values())]
        self.last_upload = {k: sum(int(p[k]) for p in parts) for k in driver}
        self.last_upload.update(driver=driver, nodes={i: dict(u["sent"]) for i, u in sorted(done.items())})
        log.info("checkpoint %s uploaded to %s: %s", name, self.uri, self.last_upload)
        self._collect(batch)
        return ckpt

    def shard_plan(self, checkpoint: Checkpoint) -> dict:
        """What :func:`fetch_node` needs to bring a node's files of ``checkpoint`` (one of this
        store's, in the cache) onto its host: ``{"location", "objects", "sizes", "path"}``."""
        manifest = self._manifest(f"{checkpoint.path.name}.json")
        sizes = {e["path"]: int(e["size"]) for e in checkpoint.files}
        return {"location": self.location, "objects": manifest["objects"], "sizes": sizes, "path": str(checkpoint.path)}

    def latest(self, fingerprint: str | None = None, *, deep: bool = False) -> Checkpoint | None:
        """The newest checkpoint under the URI that downloads and verifies, in the local cache
        (the same refusals and skips as :meth:`Checkpoints.latest`); ``None`` when there is none."""
        skipped: list[str] = []
        for _, key in self._manifests():
            try:
                manifest = self._manifest(key)
                record = json.loads(manifest["record"])
            except (CheckpointError, ValueError, KeyError) as e:
                skipped.append(str(e))
                continue
            if fingerprint is not None and record.get("fingerprint") != fingerprint:
                raise CheckpointError(
                    f"{self.uri}/{key}",
                    f"written by another job (fingerprint {record.get('fingerprint')!r}, this job's is "
                    f"{fingerprint!r}); refusing to resume from it",
                )
            try:
                ckpt = self.materialize(manifest)
                try:
                    ckpt.verify(deep=deep)
                except CheckpointError as e:  # the cached copy (hard links to live files) is damaged
                    log.warning("the cached copy of %s fails its checks, fetching it again: %s", key, e)
                    ckpt = self.materialize(manifest, fresh=True)
                    ckpt.verify(deep=deep)
            except (CheckpointError, OSError) as e:
                skipped.append(f"{self.uri}/{key}: {e}")
                continue
            for reason in skipped:
                log.warning("checkpoint skipped, resuming from %s instead: %s", key, reason)
            return Checkpoint(
                ckpt.path, ckpt.batch, ckpt.fingerprint, ckpt.meta, ckpt.created, ckpt.files, tuple(skipped)
            )
        if skipped:
            raise CheckpointError(self.uri, "no checkpoint verifies: " + "; ".join(skipped))
        return None

    def materialize(self, manifest: dict, fresh: bool = False) -> Checkpoint:
        """The manifest's checkpoint as a local directory in the cache: downloaded, unless the
        cache holds it with the same record (then only the files it lacks: another host's), or
        ``fresh``: downloaded again, replacing the cached names, never writing through them into
        a file they link."""
        batch, record = int(manifest["batch"]), manifest["record"]
        name = f"ckpt-{batch:06d}"
        final = self.directory / f"ckpt-{batch:06d}"
        if not fresh and (final / NAME).is_file() and (final / NAME).read_text() == record:
            cached = Checkpoint.open(final)
            for entry in cached.files:  # what other hosts uploaded (a multi-host commit) is not here
                local = final / entry["path"]
                if not local.exists():
                    if entry["path"] not in manifest["objects"]:
                        raise CheckpointError(f"{self.uri}/{name}", f"{entry['path']}: in the record, not the manifest")
                    part = local.with_name(f".{local.name}.part-{uuid.uuid4().hex}")
                    try:
                        self._get(manifest["objects"][entry["path"]], part)
                        os.replace(part, local)
                    finally:
                        part.unlink(missing_ok=True)
            return cached
        with replacing(final, self.directory / f".ckpt-{batch:06d}.tmp-{uuid.uuid4().hex}") as staging:
            for rel, key in sorted(manifest["objects"].items()):
                if self._exists(key) is None:
                    raise CheckpointError(f"{self.uri}/{key}", f"missing (referenced as {rel})")
                self._get(key, staging / rel)
            (staging / NAME).write_text(record)
            read_record(str(staging))  # its own checksum
        return Checkpoint.open(final)

    def clear(self) -> list[str]:
        """Delete every checkpoint under the URI (manifests first, then every object) and the
        local cache's; returns the checkpoint names removed."""
        names = [key[: -len(".json")] for _, key in self._manifests()]
        for name in names:
            self.fs.delete_file(self._key(f"{name}.json"))
        for key in self._list("params/").keys() | self._list("data/").keys():
            self.fs.delete_file(self._key(key))
        for path in self._local_dirs():
            shutil.rmtree(path, ignore_errors=True)
        return names

    # -- parts -------------------------------------------------------------------------------

    def _refuse_foreign_remote(self, fingerprint: str | None) -> None:
        for _, key in self._manifests():
            try:
                other = json.loads(self._manifest(key)["record"]).get("fingerprint")
            except (CheckpointError, ValueError, KeyError):
                continue
            if other != fingerprint:
                raise CheckpointError(
                    self.uri,
                    f"holds checkpoints of another job ({key} has fingerprint {other!r}, this job's is "
                    f"{fingerprint!r}); use another URI, or remove them",
                )

    def _collect(self, batch: int) -> None:
        """Delete manifests of later batches and beyond the ``keep`` newest, then every object
        that no kept manifest references."""
        kept: list[dict] = []
        for b, key in self._manifests():
            if b <= batch and len(kept) < self.keep:
                try:
                    kept.append(self._manifest(key))
                    continue
                except CheckpointError:
                    pass  # a damaged manifest references nothing
            self.fs.delete_file(self._key(key))
        referenced = {key for m in kept for key in m["objects"].values()}
        for key in self._list("params/").keys() | self._list("data/").keys():
            if key not in referenced:
                self.fs.delete_file(self._key(key))
