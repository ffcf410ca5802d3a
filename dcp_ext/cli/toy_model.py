"""A small transformer-like model, sharded with FSDP2 and tensor parallelism, for the demo.

It is tiny (a few MB) so the demo runs on a 2-core CPU, but it exercises the state-dict
shapes a real job produces: FSDP `Shard(0)` parameters, TP column/row-parallel weights
(which FSDP turns into `_StridedShard` placements on a 2-D mesh), replicated biases and
AdamW state for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


@dataclass(frozen=True)
class ToyConfig:
    """Model and batch sizes; the defaults give about 0.85 M parameters (3.4 MB in fp32)."""

    vocab: int = 1024
    dim: int = 128
    heads: int = 4
    layers: int = 3
    seq_len: int = 32
    batch: int = 4
    seed: int = 0


class Block(nn.Module):
    """Pre-norm attention + MLP block; the MLP is the tensor-parallel part."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ToyTransformer(nn.Module):
    """Embedding, a few blocks, final norm and output head."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token loss; returning the loss, not the logits (a view), keeps FSDP2 quiet."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tp_degree(world: int) -> int:
    """TP over pairs of ranks when the world divides evenly, else a size-1 TP axis."""
    return 2 if world % 2 == 0 else 1


def build_sharded_model(world: int, cfg: ToyConfig = ToyConfig()) -> nn.Module:
    """Build the model with identical weights on every rank, then shard it.

    Mesh is (dp, tp): the MLP of each block is column/row tensor-parallel on `tp`,
    and FSDP2 shards everything over `dp`. Must be called on every rank.
    """
    torch.manual_seed(cfg.seed)
    model = ToyTransformer(cfg)
    tp = tp_degree(world)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    _shard(model, mesh)
    return model


def _shard(model: ToyTransformer, mesh: DeviceMesh) -> None:
    """Apply TP to each block's MLP, then FSDP2 per block and at the root."""
    for block in model.blocks:
        parallelize_module(
            block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                   cfg: ToyConfig = ToyConfig()) -> None:
    """One AdamW step on a fixed batch (same on every rank) so optimizer state exists."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=gen)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
