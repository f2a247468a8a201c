"""Pipeline parallelism for d9d: stage splitting, schedule programs and a per-rank executor."""
