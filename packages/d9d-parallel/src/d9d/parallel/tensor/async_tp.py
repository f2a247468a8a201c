"""Async tensor parallelism: micro-pipelined all-gather/matmul and matmul/reduce-scatter (torch, CUDA only).

With it on, `torch.compile` rewrites each all-gather followed by a matmul (and each matmul followed by a
reduce-scatter) into a loop that overlaps the communication of one slice with the matmul of another, over
symmetric memory on the `tp` group. It changes nothing without `torch.compile`, and gloo has no symmetric memory.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


def enable_async_tp(mesh: DeviceMesh) -> None:
    """Turn on torch's micro-pipelined TP for the 1-D `tp` mesh (compile the model's layers to take effect).

    Raises:
        ValueError: `mesh` is not on CUDA (async TP needs NCCL and symmetric memory; on CPU/gloo leave it off).
    """
    if mesh.device_type != "cuda":
        raise ValueError(
            f"async_tp=True needs CUDA+NCCL (symmetric memory), but the tp mesh is on {mesh.device_type!r}; "
            "set async_tp=False on CPU/gloo."
        )
    from torch._inductor import config as inductor_config  # lazy: inductor is heavy and CUDA-only here
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(mesh.get_group().group_name)
