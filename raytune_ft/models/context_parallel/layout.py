"""The zigzag layout of a packed block over a context-parallel group: which tokens a rank holds, the
conversation pieces of its chunks, and its share of a block's fields (the package docstring says why)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import numpy as np
import torch

from raytune_ft.models.loss import IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class Piece:
    """The tokens of one conversation inside one local chunk: local [start, end), global first token,
    the conversation's global first token."""

    start: int
    end: int
    global_start: int
    conv_start: int


@dataclasses.dataclass(frozen=True, eq=False)
class CPShard:
    """One rank's share of a packed block under context parallelism (layout: module docstring)."""

    group: Any                      # torch.distributed ProcessGroup of the CP ranks; None when size is 1
    size: int
    rank: int
    total: int                      # tokens in the whole block
    cu_global: tuple[int, ...]      # the block's conversation boundaries (padding is a conversation too)
    index: torch.Tensor             # (T_local,) long: the global position of each local token

    @property
    def chunk_len(self) -> int:
        return self.total // (2 * self.size)

    @property
    def chunks(self) -> tuple[int, int]:
        """The global chunks this rank holds, in local order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, slot 0 or 1) holding global chunk `chunk`."""
        return (chunk, 0) if chunk < self.size else (2 * self.size - 1 - chunk, 1)

    def starts_conversation(self, token: int) -> bool:
        return token in self._starts

    @functools.cached_property
    def _starts(self) -> frozenset[int]:
        return frozenset(self.cu_global[:-1])

    def carries(self, chunk: int) -> bool:
        """Whether `chunk` continues a conversation from the chunk before it."""
        return chunk > 0 and not self.starts_conversation(chunk * self.chunk_len)

    def whole(self, chunk: int) -> bool:
        """Whether no conversation starts inside `chunk` after its first token (its end state then
        depends on its start state)."""
        lo, hi = chunk * self.chunk_len, (chunk + 1) * self.chunk_len
        return not any(lo < s < hi for s in self.cu_global[:-1])

    def pieces(self, slot: int) -> list[Piece]:
        """The conversation pieces of local chunk `slot` (0 or 1), in order."""
        return list(self._pieces[slot])

    @functools.cached_property
    def _pieces(self) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        return self._find_pieces(0), self._find_pieces(1)

    def _find_pieces(self, slot: int) -> tuple[Piece, ...]:
        chunk, n = self.chunks[slot], self.chunk_len
        lo, hi = chunk * n, (chunk + 1) * n
        cu = self.cu_global
        k = int(np.searchsorted(cu, lo, side="right")) - 1       # the conversation holding token lo
        out = []
        while k < len(cu) - 1 and cu[k] < hi:
            s, e = max(cu[k], lo), min(cu[k + 1], hi)
            out.append(Piece(slot * n + s - lo, slot * n + e - lo, s, cu[k]))
            k += 1
        return tuple(out)

    def local_cu_seqlens(self) -> torch.Tensor:
        """int32 boundaries of the local pieces in local token order (the packing signal the model's
        layers get beside the shard)."""
        bounds = [p.start for slot in (0, 1) for p in self.pieces(slot)] + [2 * self.chunk_len]
        return torch.tensor(bounds, dtype=torch.int32)


def zigzag_index(total: int, size: int, rank: int) -> torch.Tensor:
    """The global token positions rank `rank` of `size` holds: chunks rank and 2*size-1-rank of 2*size."""
    n = total // (2 * size)
    a, b = rank, 2 * size - 1 - rank
    return torch.cat([torch.arange(a * n, (a + 1) * n), torch.arange(b * n, (b + 1) * n)])


def make_shard(cu_seqlens, total: int, size: int, rank: int, group=None) -> CPShard:
    """The shard of rank `rank` in a CP group of `size` for a block of `total` tokens with conversation
    boundaries `cu_seqlens` (global, as packing writes them). The block must split into 2*size chunks."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"scaling.context_parallel: rank {rank} of a group of {size}")
    if total % (2 * size):
        raise ValueError(f"data.seq_len ({total}) must be a multiple of 2 x scaling.context_parallel "
                         f"({2 * size}): the block is split into that many equal chunks")
    cu = [int(x) for x in np.asarray(cu_seqlens).reshape(-1)]
    if not cu or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
        raise ValueError(f"cu_seqlens must rise from 0 to at most the block's {total} tokens; got "
                         f"{cu[:4]}...{cu[-1:]}")
    if cu[-1] < total:                       # a trailing remainder is a segment of its own, as in packing
        cu.append(total)
    if group is None and size > 1:
        raise ValueError("a context-parallel group of more than one rank needs its process group")
    return CPShard(group=group, size=size, rank=rank, total=total, cu_global=tuple(cu),
                   index=zigzag_index(total, size, rank))


def shard_block(block: Mapping[str, Any], shard: CPShard) -> dict[str, torch.Tensor]:
    """This rank's tokens of one packed block (packing's fields, shape (T,)): input_ids, position_ids
    (within each conversation: the rotary positions) and `targets`, the label each token predicts (the
    next token's label, shifted on the whole block, -100 after the last token): take the loss unshifted."""
    def field(name: str) -> torch.Tensor:
        if name not in block:
            raise ValueError(f"a packed block for context parallelism needs '{name}'")
        x = torch.as_tensor(np.asarray(block[name])).reshape(-1)
        if x.numel() != shard.total:
            raise ValueError(f"{name}: {x.numel()} tokens, but the shard was made for {shard.total}")
        return x.long()

    labels = field("labels")
    targets = torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])
    return {"input_ids": field("input_ids")[shard.index], "position_ids": field("position_ids")[shard.index],
            "targets": targets[shard.index]}
