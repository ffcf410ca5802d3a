"""What a zarr/legacy Megatron checkpoint holds, in the shape ``dcp-ext inspect`` prints."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_ext.formats.index import dtype_name
from dcp_ext.formats.torch_record import numel
from dcp_ext.megatron.base import MegatronSource


def describe_source(source: MegatronSource) -> dict[str, Any]:
    keys, all_files = [], set()
    for fqn, md in source.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            files = sorted({f for c in md.chunks for f in source.chunk_files(MetadataIndex(fqn, c.offsets))})
            keys.append({"key": fqn, "kind": "tensor", "dtype": dtype_name(md.properties.dtype), "shape": list(md.size),
                         "chunks": len(md.chunks), "bytes": numel(md.size) * md.properties.dtype.itemsize, "files": files})
        else:
            files = source.chunk_files(MetadataIndex(fqn))
            keys.append({"key": fqn, "kind": "bytes", "dtype": None, "shape": None, "chunks": 1,
                         "bytes": len(source.read_bytes(fqn)), "files": files})
        all_files.update(files)
    return {
        "path": source.url,
        "index": False,
        "format": f"Megatron {source.format} checkpoint",
        "keys": keys,
        "files": len(all_files),
        "bytes": sum(k["bytes"] for k in keys),
    }
