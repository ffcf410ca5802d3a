"""Export any checkpoint ShardReader opens as Hugging Face safetensors shards.

Output: ``model-0000k-of-0000n.safetensors`` files plus ``model.safetensors.index.json``
(``weight_map``, ``metadata.total_size``), as ``save_pretrained`` writes them. Keys keep
their checkpoint names; non-tensor items are skipped and reported.

Streaming: every shard's header is known from the metadata alone, so it is written
first, then tensors are loaded in batches of about ``BATCH_BYTES`` (a larger tensor
alone) and appended, the next batch loading while the current one is written; peak
memory is about two batches (or twice the largest tensor). Everything
is written into a temporary directory beside ``dst`` and renamed into place, so a
crashed export never leaves something that looks like a finished one.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcp_ext.errors import InvalidRequestError, rank_failure
from dcp_ext.formats.safetensors_format import METADATA_KEY, encode_header
from dcp_ext.formats.torch_record import host_bytes, numel
from dcp_ext.megatron.base import MegatronOptions
from dcp_ext.runtime import options
from dcp_ext.runtime.threads import StartedPool
from dcp_ext.storage.location import Location
from dcp_ext.storage.reader import ShardReader, check_records_held, checking_reader

INDEX_NAME = "model.safetensors.index.json"
EXPORT_FILE = re.compile(r"model(-[0-9]+-of-[0-9]+)?\.safetensors(\.index\.json)?")  # what overwrite replaces
BATCH_BYTES = 128 << 20  # two in memory at once: one written, the next loading


@dataclass
class ExportReport:
    files: list[str] = field(default_factory=list)
    keys: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # non-tensor items, not exported


@dataclass(frozen=True)
class _Tensor:
    key: str
    source_dtype: torch.dtype
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


def export_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5_000_000_000,
    dtype: torch.dtype | None = None,
    include: str | None = None,
    exclude: str | None = None,
    overwrite: bool = False,
    megatron: MegatronOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    require_commit_marker: bool | None = None,
) -> ExportReport:
    """Write the tensors of ``src`` as safetensors shards into the local directory ``dst``.

    ``dtype`` casts floating-point tensors (others keep theirs); ``include`` / ``exclude``
    are regular expressions searched in each key; ``max_shard_bytes`` bounds a shard
    (a larger tensor gets a shard of its own). ``dst`` must not exist unless
    ``overwrite=True``, which replaces the export's files (``model*.safetensors`` and the
    index) and keeps every other file there (``config.json``, tokenizer files), as
    ``save_pretrained`` does. ``require_commit_marker`` is ``ShardReader``'s.
    """
    max_shard_bytes = options.positive_int("export_safetensors", "max_shard_bytes", max_shard_bytes)
    options.flag("export_safetensors", "overwrite", overwrite)
    options.callback("export_safetensors", "progress", progress)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidRequestError(f"dtype={dtype!r}: export casts floating-point tensors, so it must be a float dtype (a torch.dtype)")
    for name, pattern in (("include", include), ("exclude", exclude)):
        try:
            re.compile(pattern or "")
        except (TypeError, re.error) as exc:
            raise InvalidRequestError(f"{name}={pattern!r} is not a regular expression ({exc})") from None
    target = _target_dir(dst, overwrite)
    reader = checking_reader(
        src, megatron=megatron, storage_options=storage_options, require_commit_marker=require_commit_marker
    )
    if reader.location.within(Location(target)):  # the export replaces the target directory whole
        raise InvalidRequestError(f"{target}: holds the source checkpoint {reader.location.url}; export into another directory")
    tensors, report = _select(reader.read_metadata().state_dict_metadata, dtype, include, exclude, reader.location.url)
    if not tensors:
        raise InvalidRequestError(f"{reader.location.url}: no tensors to export (include={include!r}, exclude={exclude!r})")
    check_records_held(reader, {t.key for t in tensors})
    if dtype is not None and not any(t.source_dtype.is_floating_point for t in tensors):
        raise InvalidRequestError(
            f"{reader.location.url}: export_safetensors(dtype={dtype}) (dcp-ext convert --dtype) would cast nothing: "
            f"none of the {len(tensors)} tensors exported (include={include!r}, exclude={exclude!r}) is floating-point"
        )
    shards = _pack(tensors, max_shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    staging = Location(f"{target}.tmp-{uuid.uuid4().hex[:8]}")
    staging.makedirs()
    try:
        total, done = sum(t.nbytes for t in tensors), 0
        for nbytes in _write_shards(reader, staging, names, shards):
            done += nbytes
            if progress is not None:
                progress(done, total)
        index = {"metadata": {"total_size": total}, "weight_map": {t.key: n for n, s in zip(names, shards) for t in s}}
        staging.write_bytes(INDEX_NAME, json.dumps(index, indent=2).encode(), sync=True)
        _publish(staging.root, target)
    except BaseException:
        shutil.rmtree(staging.root, ignore_errors=True)
        raise
    report.files, report.keys, report.bytes = names, len(tensors), total
    return report


def _target_dir(dst: str | os.PathLike[str], overwrite: bool) -> str:
    location = Location(dst)
    if not location.is_local:
        raise InvalidRequestError(f"{location.url}: safetensors export writes to a local directory, not a URL")
    target = os.path.realpath(location.root)  # a symlink to a directory: the export replaces what it points to
    if os.path.exists(target) and not (overwrite and os.path.isdir(target)):
        what = "a file" if os.path.isfile(target) else "an existing directory"
        raise InvalidRequestError(f"{target}: is {what}; export into a new directory" + ("" if overwrite else " (or pass overwrite)"))
    if Location(os.getcwd()).within(Location(target)):
        raise InvalidRequestError(
            f"{target}: holds the current directory, which the export would move; run it from elsewhere"
        )
    mount = next(iter(_mount_points(target)), None) if os.path.isdir(target) else None
    if mount is not None:  # the swap cannot move it, and removing the old directory would empty it
        raise InvalidRequestError(
            f"{target}: {mount} is a mount point, which the export cannot replace; export into a new directory"
        )
    return target


def _mount_points(top: str) -> Iterator[str]:
    """``top`` and the directories under it that are mount points (symlinks not followed)."""
    if os.path.ismount(top):
        yield top
    for parent, dirs, _ in os.walk(top):
        yield from (os.path.join(parent, d) for d in dirs if os.path.ismount(os.path.join(parent, d)))


def _select(
    entries: dict[str, Any], dtype: torch.dtype | None, include: str | None, exclude: str | None, url: str
) -> tuple[list[_Tensor], ExportReport]:
    report = ExportReport()
    chosen = []
    for key, md in entries.items():
        if (include and not re.search(include, key)) or (exclude and re.search(exclude, key)):
            continue
        if not isinstance(md, TensorStorageMetadata):
            report.skipped.append(key)
            continue
        if key == METADATA_KEY:
            raise InvalidRequestError(f"{url}: key {key!r}: safetensors reserves this name for its header's string map; "
                                      "exclude it (exclude='^__metadata__$'; dcp-ext convert --exclude) or rename it")
        source = md.properties.dtype
        target = dtype if dtype is not None and source.is_floating_point else source
        if not _casts(source, target):
            raise InvalidRequestError(
                f"{url}: key {key!r}: torch cannot cast {source} to {target}; exclude it, or export without dtype"
            )
        chosen.append(_Tensor(key, source, target, tuple(md.size)))
    return chosen, report


@functools.cache  # a few dtype pairs, asked for every key
def _casts(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether torch converts ``source`` to ``target`` (it has no conversion for packed
    float4, which is floating-point; the export's cast failed with NotImplementedError)."""
    try:
        torch.empty(1, dtype=source).to(target)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _pack(tensors: list[_Tensor], max_bytes: int) -> list[list[_Tensor]]:
    """Consecutive tensors in groups of at most ``max_bytes`` (a larger tensor alone), as
    ``save_pretrained`` packs shards; also the export's load batches."""
    groups: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return groups


def _write_shards(reader: ShardReader, directory: Location, names: list[str], shards: list[list[_Tensor]]) -> Iterator[int]:
    """Write every shard file, yielding the tensor bytes written after each batch."""
    plan = [_pack(shard, BATCH_BYTES) for shard in shards]
    loaded = _loaded_batches(reader, [batch for batches in plan for batch in batches])
    for name, shard, batches in zip(names, shards, plan):
        prefix, _ = encode_header({t.key: (t.dtype, t.shape) for t in shard}, {"format": "pt"})
        with directory.create(name, sync=True) as f:
            f.write(prefix)
            for batch in batches:
                state = next(loaded)
                for tensor in batch:
                    data = state.pop(tensor.key).to(tensor.dtype).contiguous()
                    f.write(host_bytes(data))
                yield sum(t.nbytes for t in batch)


def _loaded_batches(reader: ShardReader, batches: list[list[_Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """The batches' tensors in order; each batch loads on a helper thread while the one
    before it is written, so reads and writes overlap."""
    with StartedPool(1, "dcp_ext-export") as pool:
        pending = [pool.submit(_load_batch, reader, batches[0])] if batches else []
        for i in range(len(batches)):
            state = pending.pop().result()
            if i + 1 < len(batches):
                pending.append(pool.submit(_load_batch, reader, batches[i + 1]))
            yield state


def _load_batch(reader: ShardReader, batch: list[_Tensor]) -> dict[str, torch.Tensor]:
    state = {t.key: torch.empty(t.shape, dtype=t.source_dtype) for t in batch}
    try:
        dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    except CheckpointException as exc:  # one process: its one failure is the error to raise
        failure = rank_failure(exc)
        if failure is exc or not isinstance(failure, Exception):
            raise
        raise failure from None
    return state


def _publish(staging: str, target: str) -> None:
    """Rename the finished export into place. With overwrite, the files of the directory
    there that are not the export's come along first (hard links where possible), then the
    old directory is moved aside and removed."""
    retired = None
    if os.path.exists(target):
        for entry in os.scandir(target):
            if not EXPORT_FILE.fullmatch(entry.name):
                _carry(entry, os.path.join(staging, entry.name))
        retired = f"{target}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, retired)
    os.rename(staging, target)
    Location(os.path.dirname(target)).sync_directory()
    if retired is not None:
        shutil.rmtree(retired)


def _carry(entry: os.DirEntry[str], to: str) -> None:
    """Link (or copy) a file, a symlink or a directory tree of an old export's directory
    into the new one."""
    if entry.is_symlink():
        os.symlink(os.readlink(entry.path), to)
    elif entry.is_dir():
        shutil.copytree(entry.path, to, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(entry.path, to)


def _link_or_copy(source: str, to: str) -> None:
    try:
        os.link(source, to)
    except OSError:  # another file system, or links not allowed there
        shutil.copy2(source, to)
