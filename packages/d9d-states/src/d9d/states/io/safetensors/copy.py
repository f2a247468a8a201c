"""Copying byte ranges between files inside the kernel (`copy_file_range`), as `cp` does.

When a group's outputs are only input regions moved into place (fusing q/k/v, stacking experts), a conversion never
needs the bytes in user space: the kernel copies them from the source file into the shard, through the page cache
(or as a reflink, on filesystems that share extents). No tensor memory, no user-space copy.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator

_CHUNK = 64 * 1024 * 1024  # the user-space fallback copies in pieces of this size
# Errors meaning "this kernel or filesystem pair cannot copy_file_range", after which we copy in user space.
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}


def paired_runs(
    sources: Iterable[tuple[int, int]], targets: Iterable[tuple[int, int]]
) -> Iterator[tuple[int, int, int]]:
    """`(source_offset, target_offset, length)` pieces copying runs `sources` into runs `targets`, in order.

    Both are lists of `(offset, length)` over the same bytes in the same order, cut differently.
    """
    target_iter = iter(targets)
    target_offset, target_left = 0, 0
    for run_offset, run_length in sources:
        offset, left = run_offset, run_length
        while left > 0:
            if target_left == 0:
                target_offset, target_left = next(target_iter)
            length = min(left, target_left)
            yield offset, target_offset, length
            offset += length
            target_offset += length
            left -= length
            target_left -= length


class ByteCopier:
    """Copies ranges between two file descriptors, in the kernel when it can."""

    def __init__(self) -> None:
        self.in_kernel = hasattr(os, "copy_file_range")

    def copy(self, source_fd: int, source_offset: int, target_fd: int, target_offset: int, length: int) -> None:
        while length > 0:
            count = self._copy_once(source_fd, source_offset, target_fd, target_offset, length)
            if count == 0:
                raise OSError(errno.EIO, f"source ended at byte {source_offset} while copying (file shrank?)")
            source_offset += count
            target_offset += count
            length -= count

    def _copy_once(self, source_fd: int, source_offset: int, target_fd: int, target_offset: int, length: int) -> int:
        if self.in_kernel:
            try:
                return os.copy_file_range(source_fd, target_fd, length, source_offset, target_offset)
            except OSError as error:
                if error.errno not in _UNSUPPORTED:
                    raise
                self.in_kernel = False
        data = os.pread(source_fd, min(length, _CHUNK), source_offset)
        done = 0
        while done < len(data):
            done += os.pwrite(target_fd, memoryview(data)[done:], target_offset + done)
        return len(data)
