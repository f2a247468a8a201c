"""Gradient synchronisation of replicated parameters: buckets, asynchronous all-reduce, overlap with backward."""

from d9d.parallel.grad_sync.bucket import BucketKey, GradientBucket
from d9d.parallel.grad_sync.deferred import DeferredGradientSynchronizer
from d9d.parallel.grad_sync.synchronizer import DEFAULT_BUCKET_SIZE_MB, GradientSynchronizer

__all__ = [
    "DEFAULT_BUCKET_SIZE_MB",
    "BucketKey",
    "DeferredGradientSynchronizer",
    "GradientBucket",
    "GradientSynchronizer",
]
