"""Legacy Megatron ``torch`` checkpoints (``mp_rank_*/model_optim_rng.pt``) as one global state dict.

Opening reads only each rank file's pickle and zip directory (tensors load onto the meta
device, each knowing where its storage bytes sit in the file); the result is a catalog
whose stored chunks are byte ranges of the rank files, read like any DCP record. Each TP
shard of a parameter becomes one DCP chunk (two for a SwiGLU ``linear_fc1``: its W and V
halves land in different places of the global tensor), so a rank that loads part of a
tensor reads only the bytes of that part. Layer numbers are made global across
pipeline stages (and virtual stages ``model0..``), expert numbers across EP ranks.
Pre-mcore files nest the model (``model["language_model"]["encoder"][...]``); nested
entries are named by their path, e.g. ``language_model.encoder.layers.0.
self_attention.query_key_value.weight``.
"""

from __future__ import annotations

import io
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_ext.errors import CheckpointError, CorruptCheckpointError, InvalidRequestError
from dcp_ext.formats.faults import shown
from dcp_ext.formats.index import StoredItem
from dcp_ext.formats.safe_load import safe_torch_load, stored_at
from dcp_ext.formats.torch_record import TensorLayout, check_within_storage
from dcp_ext.megatron.base import Box, MegatronOptions, build_metadata, tensor_metadata
from dcp_ext.megatron.legacy_layout import (
    MODEL_FILE,
    TRACKER,
    count_arg,
    first_rank_file,
    is_rank_dir,
    parallelism,
    rank_files,
    resolve_iteration,
)
from dcp_ext.megatron.partition import is_swiglu_fc1, partition_dim
from dcp_ext.storage.catalog import Catalog
from dcp_ext.storage.location import Location

BYTES_KEYS = ("args", "iteration", "checkpoint_version")
_MODEL_KEY = re.compile(r"^model(\d{0,4})$")  # numbers bounded: int() of a hostile 5000-digit one raises
_LAYER = re.compile(r"^(.*?\blayers\.)(\d{1,9})(\..*)$")
_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d{1,9})(\..*)$")
_MAX_NESTING = 16  # pre-mcore files nest model -> language_model -> encoder -> ...: a few levels


@dataclass(frozen=True)
class Piece:
    """One DCP chunk: a box of a tensor inside one rank file."""

    file: str
    model: str
    key: str
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Shard:
    """A parameter as one TP rank saved it."""

    file: str
    model: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_legacy_catalog(location: Location, options: MegatronOptions | None) -> Catalog:
    """The iteration's rank files as one catalog (see the module docstring)."""
    checkpoint = LegacyCheckpoint(location, options or MegatronOptions())
    items: dict[MetadataIndex, StoredItem] = {}
    layouts: dict[MetadataIndex, TensorLayout] = {}
    for index, piece in checkpoint.pieces.items():
        items[index], layouts[index] = checkpoint.stored_piece(piece)
    first = checkpoint.files[(0, 0, 0)]
    for key in checkpoint.byte_keys:
        items[MetadataIndex(key)] = StoredItem(first, 0, 0)
    inline = {MetadataIndex(key): _serialized(checkpoint.common[key]) for key in checkpoint.byte_keys}
    fingerprint = crc32c.crc32c(repr(sorted((i.fqn, tuple(i.offset or ()), item) for i, item in items.items())).encode())
    return Catalog(location.url, checkpoint.metadata, items, indexed=False, committed=True,
                   signature=legacy_signature(location, options), format="legacy", fingerprint=fingerprint,
                   inline=inline, _layouts=layouts)


def legacy_signature(location: Location, options: MegatronOptions | None) -> tuple[Any, ...]:
    """The tracker and every rank file of the chosen iteration: a new save changes one."""
    iteration_dir = resolve_iteration(location, (options or MegatronOptions()).iteration)
    names = [f"{iteration_dir}/{d}" if iteration_dir else d for d in location.listdir(iteration_dir) if is_rank_dir(d)]
    return (location.signature(TRACKER), *(location.signature(f"{d}/{MODEL_FILE}") for d in sorted(names)))


def _serialized(value: Any) -> bytes:
    """A common-state entry as DCP stores bytes items: a ``torch.save`` stream."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class LegacyCheckpoint:
    """The rank files of one iteration, loaded as layouts (no tensor data)."""

    def __init__(self, location: Location, options: MegatronOptions):
        self.location = location
        self.url = location.url
        self.options = options
        self.iteration_dir = resolve_iteration(location, options.iteration)
        first = first_rank_file(location, self.iteration_dir)
        loaded: dict[str, dict[str, Any]] = {first: self._load(first)}
        self.args = loaded[first].get("args")
        self.sizes = parallelism(location, self.iteration_dir, self.args, f"{self.url}/{first}")
        self.num_experts = count_arg(self.args, "num_experts", f"{self.url}/{first}")
        self.files = rank_files(location, self.iteration_dir, self.sizes)
        for path in self.files.values():
            if path not in loaded:
                loaded[path] = self._load(path)
        self.common = {k: v for k, v in loaded[self.files[(0, 0, 0)]].items() if not _is_model_or_optimizer(k)}
        self.byte_keys = [k for k in BYTES_KEYS if k in self.common]
        self.models = {path: _models(state, f"{self.url}/{path}") for path, state in loaded.items()}
        self.pieces: dict[MetadataIndex, Piece] = {}
        collected = self._collect()
        self._check_rules(list(collected))
        tensors = {name: self._plan_tensor(name, shards) for name, shards in collected.items()}
        if not tensors:
            first_models = {key: sorted(params)[:8] for key, _, params in self.models[first]}
            raise CheckpointError(
                f"{self.url}/{first}: no parameter tensors in the model entries (found {first_models}); "
                "not a Megatron model checkpoint this reader understands"
            )
        self.metadata = build_metadata(tensors, self.byte_keys)

    def stored_piece(self, piece: Piece) -> tuple[StoredItem, TensorLayout]:
        """Where a chunk's bytes are: its tensor's storage in the rank file, and the view
        (offset, strides) of the chunk inside that storage."""
        tensor = next(params for entry, _, params in self.models[piece.file] if entry == piece.model)[piece.key]
        where = f"{self.url}/{piece.file} key {piece.key!r}"
        nbytes = tensor.untyped_storage().nbytes()
        offset = tensor.storage_offset() + sum(o * s for o, s in zip(piece.local_offsets, tensor.stride()))
        layout = TensorLayout(0, nbytes, tensor.dtype, piece.sizes, tuple(tensor.stride()), offset, None)
        check_within_storage(layout, nbytes // tensor.element_size(), where)
        return StoredItem(piece.file, stored_at(tensor, where), nbytes), layout

    def _check_rules(self, names: list[str]) -> None:
        """Every partition rule given must take effect: a TP>1 checkpoint, a parameter it matches."""
        rules = self.options.partition_dims
        if not rules:
            return
        where = f"{self.url}/{self.iteration_dir}"
        if self.sizes.tp == 1:
            raise InvalidRequestError(f"{where}: MegatronOptions(partition_dims=...) would be ignored: the checkpoint has TP=1")
        unmatched = [pattern for pattern in rules if not any(re.search(pattern, name) for name in names)]
        if unmatched:
            raise InvalidRequestError(
                f"{where}: MegatronOptions(partition_dims=...) (dcp-ext convert --partition-dim): {unmatched} match no parameter "
                f"(parameters are named like {sorted(names)[:3]})"
            )

    def _load(self, path: str) -> dict[str, Any]:
        where = f"{self.url}/{path}"
        local = self.location.local_file(path)
        if local:
            state = safe_torch_load(local, where, layout_only=True, megatron=True)
        else:
            with self.location.open_file(path) as stream:
                state = safe_torch_load(stream, where, layout_only=True, megatron=True)
        if not isinstance(state, dict) or not any(_MODEL_KEY.match(k) for k in state):
            raise CheckpointError(f"{where}: not a Megatron model file (no 'model' entry)")
        return state

    def _collect(self) -> dict[str, dict[int, Shard]]:
        """Global parameter name -> TP rank -> its shard (dense params from EP rank 0 only)."""
        offsets = self._layer_offsets()
        found: dict[str, dict[int, Shard]] = defaultdict(dict)
        for (tp, pp, ep), path in self.files.items():
            for model, stage_v, params in self.models[path]:
                experts = _local_expert_count(self.num_experts, self.sizes.ep, params)
                for key, value in params.items():
                    if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
                        continue
                    expert = _EXPERT.match(key)
                    if expert is None and ep:
                        continue  # dense parameters are replicated across EP ranks
                    if expert is not None and int(expert[2]) >= experts:
                        raise CorruptCheckpointError(
                            f"{self.url}/{path}: {key!r} is local expert {int(expert[2])}, but args.num_experts="
                            f"{self.num_experts} over EP={self.sizes.ep} gives each EP rank {experts}"
                        )
                    name = _renumber(key, offsets, (stage_v, pp), ep, experts)
                    shard = Shard(path, model, key, value.dtype, tuple(value.shape))
                    held = found[name].setdefault(tp, shard)
                    if held is not shard:  # two stored tensors for one place of the global model
                        raise CorruptCheckpointError(
                            f"{self.url}: {held.file} key {held.key!r} and {path} key {key!r} are both {name!r} "
                            f"(TP rank {tp}); the layer or expert numbers of the rank files overlap"
                        )
        return found

    def _layer_offsets(self) -> dict[str, dict[tuple[int, int], int]]:
        """Per layer stack (``decoder.layers.``...): first global layer of each (virtual, PP) stage."""
        counts: dict[str, dict[tuple[int, int], int]] = defaultdict(dict)
        for pp in range(self.sizes.pp):
            for _, stage_v, params in self.models[self.files[(0, pp, 0)]]:
                for key in params:
                    match = _LAYER.match(key)
                    if match:
                        stage = counts[match[1]]
                        stage[(stage_v, pp)] = max(stage.get((stage_v, pp), 0), int(match[2]) + 1)
        offsets: dict[str, dict[tuple[int, int], int]] = {}
        for stack, stage_counts in counts.items():
            total, offsets[stack] = 0, {}
            for stage in sorted(stage_counts):  # virtual stage major, then PP rank
                offsets[stack][stage] = total
                total += stage_counts[stage]
        return offsets

    def _plan_tensor(self, name: str, shards: dict[int, Shard]) -> Any:
        tp = self.sizes.tp
        where = f"{self.url}/{self.iteration_dir}"
        if sorted(shards) != list(range(tp)):
            raise CheckpointError(f"{where}: parameter {name!r} is held by TP ranks {sorted(shards)} only, expected 0..{tp - 1}")
        first = shards[0]
        if any((s.shape, s.dtype) != (first.shape, first.dtype) for s in shards.values()):
            detail = ", ".join(f"{s.file}: {s.dtype} {list(s.shape)}" for s in shards.values())
            raise CheckpointError(f"{where}: TP shards of {name!r} disagree: {detail}")
        dim = partition_dim(name, self.options.partition_dims, where) if tp > 1 else None
        if dim is None:
            self.pieces[MetadataIndex(name, torch.Size([0] * len(first.shape)))] = Piece(
                first.file, first.model, first.key, (0,) * len(first.shape), first.shape
            )
            return tensor_metadata(first.dtype, first.shape, [((0,) * len(first.shape), first.shape)])
        if dim >= len(first.shape):
            raise CheckpointError(f"{where}: partition dim {dim} of {name!r} is out of range for shape {list(first.shape)}")
        halves = 2 if getattr(self.args, "swiglu", False) is True and is_swiglu_fc1(name) else 1
        local = first.shape[dim]
        if local % halves:
            raise CheckpointError(f"{where}: SwiGLU {name!r} has an odd size {local} on dim {dim}")
        part = local // halves
        shape = first.shape[:dim] + (local * tp,) + first.shape[dim + 1 :]
        chunks: list[Box] = []
        for half in range(halves):
            for rank, shard in sorted(shards.items()):
                offsets = _at(len(shape), dim, half * part * tp + rank * part)
                sizes = first.shape[:dim] + (part,) + first.shape[dim + 1 :]
                chunks.append((offsets, sizes))
                self.pieces[MetadataIndex(name, torch.Size(offsets))] = Piece(
                    shard.file, shard.model, shard.key, _at(len(shape), dim, half * part), sizes
                )
        return tensor_metadata(first.dtype, shape, chunks)


def _at(ndim: int, dim: int, value: int) -> tuple[int, ...]:
    return tuple(value if d == dim else 0 for d in range(ndim))


def _is_model_or_optimizer(key: str) -> bool:
    return _MODEL_KEY.match(key) is not None or key == "optimizer"


def _models(state: dict[str, Any], where: str) -> list[tuple[str, int, dict[str, Any]]]:
    """(entry, virtual stage, parameters by dotted name) for ``model`` or ``model0``, ``model1``..."""
    out = []
    for key, value in state.items():
        match = _MODEL_KEY.match(key)
        if match and isinstance(value, dict):
            out.append((key, int(match[1] or 0), _flatten(value, f"{where} entry {key!r}")))
    return out


def _flatten(params: dict[str, Any], where: str) -> dict[str, Any]:
    """Nested dicts (pre-mcore ``language_model`` / ``embedding`` / ``encoder``) as dotted names.

    Megatron saves a tree a few levels deep: a dict met twice (a cycle, or one shared to
    multiply the entries) or nested deeper than ``_MAX_NESTING`` is corruption, refused
    before it recurses without end or expands without bound.
    """
    flat: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(node: dict[str, Any], prefix: str, depth: int) -> None:
        if id(node) in seen or depth > _MAX_NESTING:
            problem = "is a dict met twice (a cycle, or shared)" if id(node) in seen else f"nests dicts more than {_MAX_NESTING} deep"
            raise CorruptCheckpointError(f"{where}: {shown(prefix.rstrip('.'))} {problem}; Megatron saves a tree")
        seen.add(id(node))
        for key, value in node.items():
            if isinstance(value, dict):
                visit(value, f"{prefix}{key}.", depth + 1)
            else:
                flat[f"{prefix}{key}"] = value

    visit(params, "", 0)
    return flat


def _local_expert_count(num_experts: int | None, ep_size: int, params: dict[str, Any]) -> int:
    if num_experts:
        return num_experts // ep_size
    return 1 + max((int(m[2]) for m in map(_EXPERT.match, params) if m), default=-1)


def _renumber(
    key: str, offsets: dict[str, dict[tuple[int, int], int]], stage: tuple[int, int], ep: int, experts: int
) -> str:
    """Local layer (and expert) numbers -> global ones."""
    match = _LAYER.match(key)
    if match:
        key = f"{match[1]}{int(match[2]) + offsets[match[1]][stage]}{match[3]}"
    match = _EXPERT.match(key)
    if match:
        key = f"{match[1]}{int(match[2]) + ep * experts}{match[3]}"
    return key
