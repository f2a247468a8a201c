"""Benchmark of d9d.states: streaming conversion of a generated Qwen3-MoE checkpoint (>= 3.5 GB, bf16, Hugging Face
per-expert layout) into the fused layout (q/k/v concatenated, experts stacked into `gate_up_proj` and `down_proj`),
against `cp -r` + fsync of the same bytes and against the peer way (transformers `from_pretrained`, fuse in memory,
`save_torch_state_dict`), all in one run.

Each method runs in its own subprocess. Before each run the source files are fsync'ed and evicted from the page cache
(`posix_fadvise(DONTNEED)`), so every method reads from disk ("cold"); every method fsyncs what it writes. The parent
samples each child's RssAnon and VmRSS from /proc every 5 ms for the peaks. Our output is checked bit for bit against
the peer's.

    .venv/bin/python bench/states_convert.py                  # full size (needs ~12 GB free disk, ~10 GB RAM)
    .venv/bin/python bench/states_convert.py --layers 2       # a quick smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
CONFIG = {"hidden": 1024, "moe_inter": 512, "experts": 64, "heads": 16, "kv_heads": 4, "head_dim": 64, "vocab": 32768}


# The mapping under test ---------------------------------------------------------------------------------------------


def qwen3_moe_fused(source: Mapping[str, object]):  # noqa: ANN201 - a factory, as `d9d-states convert --mapping` takes
    """HF Qwen3-MoE (per-expert) -> fused: q/k/v concatenated; experts stacked as transformers v5 holds them."""
    from d9d.states import mapper as m

    layers = sorted({int(name.split(".")[2]) for name in source if name.startswith("model.layers.")})
    experts = len({name.split(".")[5] for name in source if name.startswith("model.layers.0.mlp.experts.")})
    expert = "mlp.experts.{e}.{kind}.weight"
    fused_layer = m.Parallel(
        [
            m.Concatenate([f"self_attn.{p}_proj.weight" for p in "qkv"], "self_attn.qkv_proj.weight"),
            m.Sequential(
                [
                    m.Parallel(
                        [
                            m.Stack([expert.format(e=e, kind="gate_proj") for e in range(experts)], "gate"),
                            m.Stack([expert.format(e=e, kind="up_proj") for e in range(experts)], "up"),
                        ]
                    ),
                    m.Concatenate(["gate", "up"], "mlp.experts.gate_up_proj", dim=1),
                ]
            ),
            m.Stack([expert.format(e=e, kind="down_proj") for e in range(experts)], "mlp.experts.down_proj"),
        ]
    )
    scoped = m.PrefixScope(fused_layer, [f"model.layers.{i}." for i in layers])
    touched = {name for group in scoped.state_dependency_groups() for name in group.inputs}
    return m.Parallel([scoped, m.Identity(sorted(set(source) - touched))])


# Generating the source --------------------------------------------------------------------------------------------


def generate(directory: Path, layers: int, seed: int) -> int:
    """Write a random HF Qwen3-MoE checkpoint (bf16, ~1 GB shards, with index and config.json); returns its bytes."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    c = CONFIG
    config = Qwen3MoeConfig(
        hidden_size=c["hidden"],
        intermediate_size=4 * c["hidden"],
        moe_intermediate_size=c["moe_inter"],
        num_hidden_layers=layers,
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"],
        num_experts=c["experts"],
        num_experts_per_tok=8,
        vocab_size=c["vocab"],
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab"], c["hidden"])}
    q, kv, h, i = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["hidden"], c["moe_inter"]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (c["head_dim"],),
            p + "self_attn.k_norm.weight": (c["head_dim"],),
            p + "mlp.gate.weight": (c["experts"], h),
        }
        for e in range(c["experts"]):
            shapes |= {
                f"{p}mlp.experts.{e}.gate_proj.weight": (i, h),
                f"{p}mlp.experts.{e}.up_proj.weight": (i, h),
                f"{p}mlp.experts.{e}.down_proj.weight": (h, i),
            }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (c["vocab"], h)}
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, shape in shapes.items():
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if size + tensor.nbytes > 10**9 and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    names = [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))]
    weight_map = {}
    for file_name, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file_name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


# Page cache, fsync, measurement -------------------------------------------------------------------------------------


def evict(directory: Path) -> None:
    """fsync every file, then drop its pages from the page cache, so the next reader reads from disk."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_tree(directory: Path) -> None:
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _memory(pid: int) -> tuple[int, int]:
    anon = rss = 0
    with Path(f"/proc/{pid}/status").open() as status:
        for line in status:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return anon, rss


def run_measured(command: list[str]) -> dict[str, float]:
    """Run `command`, sampling its memory; returns wall time, peaks and what the child reported (a JSON line)."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    peaks = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                anon, rss = _memory(child.pid)
            except (FileNotFoundError, ProcessLookupError):
                break
            peaks[0], peaks[1] = max(peaks[0], anon), max(peaks[1], rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = child.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if child.returncode != 0:
        raise RuntimeError(f"{command} failed with {child.returncode}")
    report = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    return {"wall_s": wall, "peak_anon": peaks[0], "peak_rss": peaks[1], **report}


# Children -----------------------------------------------------------------------------------------------------------


def child_ours(source: str, destination: str, *, in_kernel: bool) -> None:
    from d9d.states import convert_checkpoint

    baseline = _memory(os.getpid())
    start = time.perf_counter()
    report = convert_checkpoint(source, destination, qwen3_moe_fused, progress=False, copy_in_kernel=in_kernel)
    work = time.perf_counter() - start
    print(
        json.dumps(
            {
                "work_s": work,
                "baseline_anon": baseline[0],
                "baseline_rss": baseline[1],
                "largest_group": report.largest_group_bytes,
                "files": len(report.files),
            }
        )
    )


def child_peer(source: str, destination: str) -> None:
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoModelForCausalLM

    baseline = _memory(os.getpid())
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)  # fuses and stacks experts on load
    state = model.state_dict()
    layers = model.config.num_hidden_layers
    for layer in range(layers):
        p = f"model.layers.{layer}.self_attn."
        state[p + "qkv_proj.weight"] = torch.cat([state.pop(p + f"{x}_proj.weight") for x in "qkv"])
    Path(destination).mkdir(parents=True)
    save_torch_state_dict(state, destination, max_shard_size="5GB")
    fsync_tree(Path(destination))
    work = time.perf_counter() - start
    print(json.dumps({"work_s": work, "baseline_anon": baseline[0], "baseline_rss": baseline[1]}))


# Orchestration ------------------------------------------------------------------------------------------------------


def same_outputs(ours: Path, peer: Path) -> str:
    """Compare two checkpoints tensor by tensor (streamed, one tensor at a time); '' when bit-identical."""
    from d9d.states import CheckpointSource

    a, b = CheckpointSource.open(ours), CheckpointSource.open(peer)
    if a.locations.keys() != b.locations.keys():
        return f"names differ: {sorted(a.locations.keys() ^ b.locations.keys())[:5]}"
    with a.open_reader() as ra, b.open_reader() as rb:
        for name in a.locations:
            x, y = ra.read(name), rb.read(name)
            if (
                x.dtype != y.dtype
                or x.shape != y.shape
                or not torch.equal(x.view(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            ):
                return f"{name} differs"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/d9d-states-bench"))
    parser.add_argument("--layers", type=int, default=18, help="18 gives 3.86 GB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    args = parser.parse_args()

    work = args.workdir
    source = work / "hf"
    estimate = args.layers * 207 * 10**6 + 135 * 10**6
    needed = 3 * estimate + 10**9
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    print(f"disk: {free / 1e9:.1f} GB free in {work}, need {needed / 1e9:.1f} GB")
    if free < needed:
        sys.exit(f"not enough free disk space in {work}")
    if not source.exists():
        start = time.perf_counter()
        size = generate(source, args.layers, seed=0)
        print(f"generated {size / 1e9:.2f} GB in {time.perf_counter() - start:.0f}s")
    size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    from d9d.states import plan_conversion

    plan = plan_conversion(source, qwen3_moe_fused)
    largest = plan.largest_group_bytes
    print(f"source {size / 1e9:.3f} GB, {len(plan.groups)} groups, largest group {largest / 2**20:.0f} MiB")
    commands = {
        "cp -r + sync": lambda dst: ["sh", "-c", f'cp -r "{source}" "{dst}" && sync "{dst}"/* "{dst}"'],
        "d9d-states": lambda dst: [sys.executable, str(HERE), "child-ours", str(source), str(dst)],
        "d9d-states, in memory": lambda dst: [sys.executable, str(HERE), "child-ours-memory", str(source), str(dst)],
        "transformers": lambda dst: [sys.executable, str(HERE), "child-peer", str(source), str(dst)],
    }
    if args.skip_peer:
        del commands["transformers"]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in commands}
    verdict = "not compared"
    for round_number in range(args.repeats):
        last = round_number == args.repeats - 1
        for name, command in commands.items():
            destination = work / f"out-{name.replace(' ', '').replace(',', '-')}"
            shutil.rmtree(destination, ignore_errors=True)
            evict(source)
            result = run_measured(command(destination))
            results[name].append(result)
            print(
                f"round {round_number}: {name}: {json.dumps({k: round(v, 2) for k, v in result.items()})}", flush=True
            )
            if not (last and name in ("d9d-states", "transformers")):
                shutil.rmtree(destination)
        if last and "transformers" in commands:
            problem = same_outputs(work / "out-d9d-states", work / "out-transformers")
            verdict = "bit-identical" if not problem else f"DIFFER: {problem}"
            print(f"d9d-states output vs transformers output: {verdict}")
    summary = summarize(results, size, plan.largest_group_bytes, verdict, args)
    print(summary)
    for name in commands:
        shutil.rmtree(work / f"out-{name.replace(' ', '').replace(',', '-')}", ignore_errors=True)
    if not args.keep:
        shutil.rmtree(work)


def summarize(
    results: dict[str, list[dict[str, float]]], size: int, group: int, verdict: str, args: argparse.Namespace
) -> str:
    copy = statistics.median(r["wall_s"] for r in results["cp -r + sync"])
    header = (
        f"date {datetime.date.today()}; {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"source {size / 1e9:.3f} GB; largest group {group / 2**20:.0f} MiB; {args.repeats} rounds (median)"
    )
    lines = [
        header,
        "| method | wall s, median (runs) | work s | GB/s | vs copy | peak anon MiB | peak RSS MiB | anon / group |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        work = statistics.median(r.get("work_s", r["wall_s"]) for r in runs)
        anon = max(r["peak_anon"] for r in runs)
        rss = max(r["peak_rss"] for r in runs)
        each = ", ".join(f"{r['wall_s']:.1f}" for r in runs)
        lines.append(
            f"| {name} | {wall:.1f} ({each}) | {work:.1f} | {size / wall / 1e9:.2f} | {copy / wall:.2f}x | "
            f"{anon / 2**20:.0f} | {rss / 2**20:.0f} | {anon / group:.2f} |"
        )
    lines.append(f"outputs: {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] in ("child-ours", "child-ours-memory"):
        child_ours(sys.argv[2], sys.argv[3], in_kernel=sys.argv[1] == "child-ours")
    elif len(sys.argv) == 4 and sys.argv[1] == "child-peer":
        child_peer(sys.argv[2], sys.argv[3])
    else:
        main()
