"""The distributed context: the one source of truth for a job's topology."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import timedelta
from types import TracebackType
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch._C._distributed_c10d import HashStore

from d9d.core.dist.degrees import MeshDegrees
from d9d.core.dist.domains import DomainLayout, MeshDomain, plan_domains
from d9d.core.dist.environment import (
    DeviceChoice,
    LaunchEnvironment,
    backend_for,
    moves_cpu_tensors,
    resolve_device_type,
)
from d9d.core.dist.lifetime import die_with_launcher, launched_by_torchrun
from d9d.core.dist.rank_logging import RankLoggerAdapter, build_rank_logger

DEFAULT_TIMEOUT = timedelta(minutes=10)


class DistributedContext:
    """Topology of a job: launch environment, device, process group and named mesh domains.

    Build it once per program with `DistributedContext.build(...)` and pass it to whatever needs a mesh; nothing else
    creates process groups or reads launcher variables. Every domain is a `DeviceMesh` over the same ranks (see
    `d9d.core.dist.domains` for their dimensions). A single process gets a world of one over an in-memory store, so
    the same code paths (DTensor, meshes) run with and without a launcher.
    """

    def __init__(
        self,
        *,
        degrees: MeshDegrees,
        launch: LaunchEnvironment,
        device_type: Literal["cpu", "cuda"],
        layouts: dict[MeshDomain, DomainLayout],
        meshes: dict[MeshDomain, DeviceMesh],
        owns_process_group: bool,
        control_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.degrees = degrees
        self.launch = launch
        self.device_type = device_type
        self._layouts = layouts
        self._meshes = meshes
        self._owns_process_group = owns_process_group
        self._control_group = control_group
        self._local_group: dist.ProcessGroup | None = None
        self.logger: RankLoggerAdapter = build_rank_logger(self.rank, self.coordinate(MeshDomain.REGULAR))

    @classmethod
    def build(
        cls,
        degrees: MeshDegrees | None = None,
        *,
        device: DeviceChoice | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> DistributedContext:
        """Initialise (or adopt) the default process group and build every mesh domain.

        Args:
            degrees: parallel degrees; `None` means pure data-parallel sharding over all ranks (`dp_shard=-1`).
            device: 'cpu', 'cuda' or 'auto' (the default: `D9D_DEVICE`, else CUDA when visible).
            timeout: how long a collective may wait before it fails instead of hanging.

        Raises:
            ValueError: degrees that do not fit the world size, or an inconsistent launcher environment.
        """
        launch = LaunchEnvironment.from_environ()
        owns_process_group = not dist.is_initialized()
        if not owns_process_group:
            # A launcher (or a test harness) already created the group: it, not the environment, is the truth.
            launch = LaunchEnvironment(
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                local_rank=launch.local_rank if launch.world_size == dist.get_world_size() else dist.get_rank(),
                local_world_size=(
                    launch.local_world_size if launch.world_size == dist.get_world_size() else dist.get_world_size()
                ),
            )
        resolved = (degrees or MeshDegrees(dp_shard=-1)).resolve(launch.world_size)
        device_type = resolve_device_type(device)
        if device_type == "cuda":
            visible = torch.cuda.device_count()
            if launch.local_world_size > visible:
                raise ValueError(
                    f"LOCAL_WORLD_SIZE={launch.local_world_size} ranks on this node but only {visible} CUDA devices "
                    "are visible; start one rank per GPU or set D9D_DEVICE=cpu."
                )
            torch.cuda.set_device(launch.local_rank)
        if owns_process_group:
            if launched_by_torchrun():
                die_with_launcher()  # no rank outlives a killed torchrun (see d9d.core.dist.lifetime)
            _init_default_group(launch, device_type, timeout)
        layouts = plan_domains(resolved)
        meshes = {
            domain: DeviceMesh(device_type, layout.ranks, mesh_dim_names=layout.dim_names)
            for domain, layout in layouts.items()
        }
        # Group creation is collective: every rank makes it here, after the meshes, in the same order.
        control_group = _host_control_group(moves_cpu_tensors(), timeout) if launch.world_size > 1 else None
        return cls(
            degrees=resolved,
            launch=launch,
            device_type=device_type,
            layouts=layouts,
            meshes=meshes,
            owns_process_group=owns_process_group,
            control_group=control_group,
        )

    # Topology -------------------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def node_rank(self) -> int:
        return self.rank // self.launch.local_world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.launch.local_world_size

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def pp_rank(self) -> int:
        return self.coordinate(MeshDomain.REGULAR)["pp"]

    def mesh_for(self, domain: MeshDomain | str) -> DeviceMesh:
        return self._meshes[MeshDomain(domain)]

    def layout_for(self, domain: MeshDomain | str) -> DomainLayout:
        return self._layouts[MeshDomain(domain)]

    def coordinate(self, domain: MeshDomain | str) -> dict[str, int]:
        """This rank's coordinate in `domain`, by dimension name."""
        layout = self._layouts[MeshDomain(domain)]
        return dict(zip(layout.dim_names, layout.coordinate_of(self.rank), strict=True))

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """A group of every rank that all-reduces *CPU* tensors (gloo), for host-side control flags such as the
        loop's preemption agreement: a collective over it never waits for the accelerator's queue, where one over
        NCCL needs a device tensor and a device-to-host copy that waits for every kernel queued before it. `None` in
        a world of one (nothing to agree with)."""
        return self._control_group

    # Synchronisation -------------------------------------------------------------------------------------------

    def barrier(self) -> None:
        dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the body on rank 0 first (e.g. to download or build a cache), then on every other rank."""
        if not self.is_main_process:
            dist.barrier()
        yield
        if self.is_main_process:
            dist.barrier()

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like `main_process_first`, per node: local rank 0 of each node goes first."""
        group = self._node_group()
        if not self.is_local_main_process:
            dist.barrier(group=group)
        yield
        if self.is_local_main_process:
            dist.barrier(group=group)

    def _node_group(self) -> dist.ProcessGroup:
        if self._local_group is None:
            # Group creation is collective: every rank creates every node's group and keeps its own.
            size = self.launch.local_world_size
            for node in range(self.num_nodes):
                group = dist.new_group(list(range(node * size, (node + 1) * size)))
                if node == self.node_rank:
                    self._local_group = group
            assert self._local_group is not None
        return self._local_group

    # Teardown --------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process group if this context created it. Safe to call twice."""
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    def __enter__(self) -> DistributedContext:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DistributedContext(rank={self.rank}, world_size={self.world_size}, {self.degrees.describe()})"


def _host_control_group(default_moves_cpu_tensors: bool, timeout: timedelta) -> dist.ProcessGroup:
    """The default group when it moves CPU tensors itself (gloo, or the `cpu:gloo,cuda:nccl` pair this context
    initialises), else a new gloo group over every rank (a launcher's plain `nccl` group). Collective."""
    if default_moves_cpu_tensors:
        world = dist.group.WORLD
        assert world is not None
        return world
    group = dist.new_group(backend="gloo", timeout=timeout)
    assert isinstance(group, dist.ProcessGroup)  # typed loosely in torch; every rank is in this one
    return group


def _init_default_group(launch: LaunchEnvironment, device_type: Literal["cpu", "cuda"], timeout: timedelta) -> None:
    backend = backend_for(device_type)
    if launch.is_single_process:
        # No launcher: a private in-memory store makes a world of one without touching the network.
        dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    logging.getLogger("d9d").debug("initialised %s process group of %d ranks", backend, launch.world_size)
