"""Named mesh domains: the device meshes a job's components work on, as pure rank layouts.

Ranks are laid out row-major over the regular dimensions `(pp, dp_replicate, dp_shard, cp, tp)`: `tp` varies
fastest so tensor-parallel groups are neighbouring ranks (one node), `pp` slowest. Every other domain is a
reshape of that same grid, so a rank has one coordinate per domain and domains agree on who is who.

| domain  | dimensions                                  | used by                                    |
|---------|---------------------------------------------|--------------------------------------------|
| regular | pp, dp_replicate, dp_shard, cp, tp          | everything that names one degree           |
| dense   | pp, dp_replicate, dp_cp_shard, tp           | dense parameters: FSDP shards over dp*cp   |
| expert  | pp, ep_replicate, ep, tp                    | expert parameters and token dispatch       |
| batch   | pp, dp, cp, tp                              | data loading: one batch shard per dp rank  |
| flat    | world                                       | whole-job collectives                      |

Expert parallelism folds over the data and context parallel ranks: the `dp_replicate * dp_shard * cp` ranks of one
`(pp, tp)` slice are regrouped as `ep_replicate * ep`, with `ep` the fastest-varying so that an expert-parallel group
is made of neighbouring data ranks. Hence the divisibility rule: `ep` divides `dp_replicate * dp_shard * cp`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from d9d.core.dist.degrees import MeshDegrees


class MeshDomain(enum.StrEnum):
    REGULAR = "regular"
    DENSE = "dense"
    EXPERT = "expert"
    BATCH = "batch"
    FLAT = "flat"


@dataclass(frozen=True, kw_only=True)
class DomainLayout:
    """Shape and dimension names of one domain, and which global rank sits at each coordinate."""

    domain: MeshDomain
    dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: torch.Tensor

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        found = (self.ranks == rank).nonzero()
        if found.numel() == 0:
            raise ValueError(f"rank {rank} is not in the {self.domain} domain of {self.ranks.numel()} ranks")
        return tuple(int(index) for index in found[0].tolist())


def plan_domains(degrees: MeshDegrees) -> dict[MeshDomain, DomainLayout]:
    """Lay out every domain for resolved `degrees` (see `MeshDegrees.resolve`)."""
    if not degrees.is_resolved:
        raise ValueError(f"degrees must be resolved against a world size first ({degrees.describe()})")
    pp, dpr, dps, cp, tp = degrees.pp, degrees.dp_replicate, degrees.dp_shard, degrees.cp, degrees.tp
    grid = torch.arange(degrees.world_size, dtype=torch.int64)
    shapes: dict[MeshDomain, tuple[tuple[str, ...], tuple[int, ...]]] = {
        MeshDomain.REGULAR: (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (pp, dpr, dps, cp, tp)),
        MeshDomain.DENSE: (("pp", "dp_replicate", "dp_cp_shard", "tp"), (pp, dpr, dps * cp, tp)),
        MeshDomain.EXPERT: (("pp", "ep_replicate", "ep", "tp"), (pp, degrees.expert_replicate(), degrees.ep, tp)),
        MeshDomain.BATCH: (("pp", "dp", "cp", "tp"), (pp, dpr * dps, cp, tp)),
        MeshDomain.FLAT: (("world",), (degrees.world_size,)),
    }
    return {
        domain: DomainLayout(domain=domain, dim_names=names, shape=shape, ranks=grid.reshape(shape))
        for domain, (names, shape) in shapes.items()
    }
