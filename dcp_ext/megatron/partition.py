"""Which dimension a legacy Megatron parameter is split on across tensor-parallel ranks.

Legacy ``mp_rank_*`` files do not record it, so it follows from the parameter's name:
column-parallel layers split their output (dim 0), row-parallel layers their input
(dim 1), norms and row-parallel biases are replicated. Users extend or override the
rules with ``MegatronOptions(partition_dims={regex: dim})``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dcp_ext.errors import CheckpointError

DEFAULT_RULES: tuple[tuple[str, int | None], ...] = (
    (r"\.layer_norm_(weight|bias)$", None),  # norms fused into linear_qkv / linear_fc1 (TE)
    (r"norm[^.]*\.(weight|bias)$", None),  # input_layernorm, pre_mlp_layernorm, final_layernorm, q/k norms
    (r"\.linear_(proj|fc2)\.bias$", None),  # row-parallel biases are added after the all-reduce
    (r"\.(self_attention\.dense|dense_4h_to_h)\.bias$", None),  # the same, pre-mcore names
    (r"\.router\.(weight|bias|expert_bias)$", None),
    (r"(^|\.)position_embeddings\.weight$", None),
    (r"\.linear_(qkv|fc1)\.(weight|bias)$", 0),
    (r"(^|\.)word_embeddings\.weight$", 0),
    (r"(^|\.)output_layer\.(weight|bias)$", 0),
    (r"\.linear_(proj|fc2)\.weight$", 1),
    (r"\.(query_key_value|dense_h_to_4h)\.(weight|bias)$", 0),  # pre-mcore column-parallel
    (r"\.(self_attention\.dense|dense_4h_to_h)\.weight$", 1),  # pre-mcore row-parallel
)
SWIGLU_RULE = r"\.(linear_fc1|dense_h_to_4h)\.(weight|bias)$"


def partition_dim(name: str, overrides: Mapping[str, int | None], where: str) -> int | None:
    """The TP split dimension of ``name`` (None: replicated); user rules first."""
    for pattern, dim in (*overrides.items(), *DEFAULT_RULES):
        if re.search(pattern, name):
            return dim
    example = re.escape(".".join(name.split(".")[-2:])) + "$"
    raise CheckpointError(
        f"{where}: no tensor-parallel partition rule for parameter {name!r}; pass one, e.g. "
        f"ShardReader(path, megatron=MegatronOptions(partition_dims={{r'{example}': 0}})) "
        "(0: column-parallel, 1: row-parallel, None: replicated)"
    )


def is_swiglu_fc1(name: str) -> bool:
    return re.search(SWIGLU_RULE, name) is not None and ".layer_norm_" not in name
