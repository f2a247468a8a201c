"""A training step's forward, backward and gradient synchronisation replayed as one CUDA graph (design 0031).

A small model step launches thousands of kernels; when the host cannot queue them as fast as the GPU runs them, the
GPU idles between launches (the MoE anchor's eager step keeps an H100 busy about 60% of the time). Capturing the
step once and replaying it costs one launch. What may run inside (`body`) is what CUDA graphs allow: static shapes,
no host synchronisation (`.item()`, `.tolist()`, a data-dependent shape), inputs read from tensors whose storage
stays (copy each batch into them), collectives that every rank captures in the same order, and host state that is
the same after every call (a counter that changes per step lives on the device). Expert parallelism qualifies with
the static-capacity exchange (`all_to_all_capacity`) and replicated dense parameters; FSDP does not (its
unsharded parameters are freed and re-allocated each step, and the replay would write where they used to be).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CudaGraphedStep:
    """`body()` run eagerly `warmup` times, then captured; every later call replays the capture.

    `body` returns a tensor (the step's loss, say); calls return that same tensor object, refilled by each replay:
    read or clone it before the next call. Gradients produced inside stay where the capture put them: clear them
    inside `body` (a gradient synchroniser's `begin_step` does), never by setting `.grad` to None outside it.

    Warm-up runs on a side stream, as PyTorch's whole-network capture recipe asks: autotuners, lazily built NCCL
    communicators and the caching allocator settle there, outside the capture.

    Raises:
        ValueError: `warmup` below 1 (the capture needs one eager run first).
        RuntimeError: without CUDA.
    """

    def __init__(self, body: Callable[[], torch.Tensor], *, warmup: int = 2) -> None:
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (one eager run before the capture), got warmup={warmup}")
        if not torch.cuda.is_available():
            raise RuntimeError("CudaGraphedStep needs CUDA: CUDA graphs replay GPU kernels only")
        self._body = body
        self._warmup = warmup
        self._graph: torch.cuda.CUDAGraph | None = None
        self._output: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self) -> torch.Tensor:
        if self._graph is None:
            self._capture()
        assert self._graph is not None
        assert self._output is not None
        self._graph.replay()
        return self._output

    def _capture(self) -> None:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self._warmup):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread polls its events during the capture; only this thread is captured.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = self._body()
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"the captured body must return a tensor, got {type(output).__name__}")
        self._graph, self._output = graph, output
