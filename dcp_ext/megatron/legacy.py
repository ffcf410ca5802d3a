"""Legacy Megatron ``torch`` checkpoints (``mp_rank_*/model_optim_rng.pt``) as one global state dict.

Every rank file is loaded once (memory-mapped when local: only its pickle is read until
a box of a tensor is copied) and kept for the life of the source. Each TP shard of a
parameter becomes one DCP chunk (two for a SwiGLU ``linear_fc1``: its W and V halves
land in different places of the global tensor), so a rank that loads part of a tensor
touches only the files that hold that part. Layer numbers are made global across
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

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_ext.errors import CheckpointError
from dcp_ext.formats.torch_record import numel
from dcp_ext.megatron.base import Box, ChunkRead, MegatronOptions, MegatronSource, build_metadata, tensor_metadata
from dcp_ext.megatron.legacy_layout import (
    TRACKER,
    first_rank_file,
    parallelism,
    rank_files,
    resolve_iteration,
)
from dcp_ext.megatron.partition import is_swiglu_fc1, partition_dim
from dcp_ext.formats.safe_load import safe_torch_load
from dcp_ext.storage.location import Location

BYTES_KEYS = ("args", "iteration", "checkpoint_version")
_MODEL_KEY = re.compile(r"^model(\d*)$")
_LAYER = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


@dataclass(frozen=True)
class Piece:
    """One DCP chunk: a box of a tensor inside one rank file."""

    file: str
    model: str
    key: str
    local_offsets: tuple[int, ...]


@dataclass(frozen=True)
class Shard:
    """A parameter as one TP rank saved it."""

    file: str
    model: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class LegacySource(MegatronSource):
    format = "legacy"

    def __init__(self, location: Location, options: MegatronOptions):
        self.location = location
        self.url = location.url
        self.options = options
        self.iteration_dir = resolve_iteration(location, options.iteration)
        first = first_rank_file(location, self.iteration_dir)
        self._loaded: dict[str, dict[str, Any]] = {first: self._load(first)}
        self.args = self._loaded[first].get("args")
        self.sizes = parallelism(location, self.iteration_dir, self.args)
        self.files = rank_files(location, self.iteration_dir, self.sizes)
        for path in self.files.values():
            if path not in self._loaded:
                self._loaded[path] = self._load(path)
        self.common = {k: v for k, v in self._loaded[self.files[(0, 0, 0)]].items() if not _is_model_or_optimizer(k)}
        self.models = {path: _models(state) for path, state in self._loaded.items()}
        self.pieces: dict[MetadataIndex, Piece] = {}
        tensors = {name: self._plan_tensor(name, shards) for name, shards in self._collect().items()}
        if not tensors:
            first_models = {key: sorted(params)[:8] for key, _, params in self.models[first]}
            raise CheckpointError(
                f"{self.url}/{first}: no parameter tensors in the model entries (found {first_models}); "
                "not a Megatron model checkpoint this reader understands"
            )
        self.metadata = build_metadata(tensors, [k for k in BYTES_KEYS if k in self.common])

    # -- MegatronSource ------------------------------------------------------------------
    def signature(self) -> tuple[Any, ...]:
        return (self.location.signature(TRACKER), *(self.location.signature(p) for p in self.files.values()))

    def chunk_files(self, index: MetadataIndex) -> list[str]:
        return [self.files[(0, 0, 0)]] if index.offset is None else [self.pieces[index].file]

    def read_bytes(self, fqn: str) -> bytes:
        buf = io.BytesIO()
        torch.save(self.common[fqn], buf)
        return buf.getvalue()

    def read_tensor(
        self, index: MetadataIndex, offsets: tuple[int, ...], lengths: tuple[int, ...], dest: torch.Tensor
    ) -> ChunkRead:
        piece = self.pieces[index]
        source = next(params for entry, _, params in self.models[piece.file] if entry == piece.model)[piece.key]
        for dim, (start, n) in enumerate(zip(piece.local_offsets, lengths)):
            source = source.narrow(dim, start + offsets[dim], n)
        dest.copy_(source)
        return ChunkRead(numel(lengths) * source.element_size(), frozenset({piece.file}))

    # -- building ------------------------------------------------------------------------
    def _load(self, path: str) -> dict[str, Any]:
        where = f"{self.url}/{path}"
        if self.location.is_local:
            state = safe_torch_load(self.location.path(path), where, mmap=True)
        else:
            state = safe_torch_load(self.location.read_bytes(path), where)
        if not isinstance(state, dict) or not any(_MODEL_KEY.match(k) for k in state):
            raise CheckpointError(f"{where}: not a Megatron model file (no 'model' entry)")
        return state

    def _collect(self) -> dict[str, dict[int, Shard]]:
        """Global parameter name -> TP rank -> its shard (dense params from EP rank 0 only)."""
        offsets = self._layer_offsets()
        found: dict[str, dict[int, Shard]] = defaultdict(dict)
        for (tp, pp, ep), path in self.files.items():
            for model, stage_v, params in self.models[path]:
                experts = _local_expert_count(self.args, self.sizes.ep, params)
                for key, value in params.items():
                    if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
                        continue
                    name = _renumber(key, offsets, (stage_v, pp), ep, experts)
                    if _EXPERT.match(key) is None and ep:
                        continue  # dense parameters are replicated across EP ranks
                    found[name].setdefault(tp, Shard(path, model, key, value.dtype, tuple(value.shape)))
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
                first.file, first.model, first.key, (0,) * len(first.shape)
            )
            return tensor_metadata(first.dtype, first.shape, [((0,) * len(first.shape), first.shape)])
        if dim >= len(first.shape):
            raise CheckpointError(f"{where}: partition dim {dim} of {name!r} is out of range for shape {list(first.shape)}")
        halves = 2 if getattr(self.args, "swiglu", False) and is_swiglu_fc1(name) else 1
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
                    shard.file, shard.model, shard.key, _at(len(shape), dim, half * part)
                )
        return tensor_metadata(first.dtype, shape, chunks)


def _at(ndim: int, dim: int, value: int) -> tuple[int, ...]:
    return tuple(value if d == dim else 0 for d in range(ndim))


def _is_model_or_optimizer(key: str) -> bool:
    return _MODEL_KEY.match(key) is not None or key == "optimizer"


def _models(state: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """(entry, virtual stage, parameters by dotted name) for ``model`` or ``model0``, ``model1``..."""
    out = []
    for key, value in state.items():
        match = _MODEL_KEY.match(key)
        if match and isinstance(value, dict):
            out.append((key, int(match[1] or 0), _flatten(value)))
    return out


def _flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts (pre-mcore ``language_model`` / ``embedding`` / ``encoder``) as dotted names."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _local_expert_count(args: Any, ep_size: int, params: dict[str, Any]) -> int:
    if getattr(args, "num_experts", None):
        return int(args.num_experts) // ep_size
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
