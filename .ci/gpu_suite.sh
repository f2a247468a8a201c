#!/usr/bin/env bash
# The GPU tests, the Trainer benchmark and the CPU test suite on the GPU machine (Python 3.12, torch 2.11, no
# network). Wheels missing from that machine's image travel in .whl and .whl-flows (see docs/testing.md).
# Usage there: bash .ci/gpu_suite.sh [PART...] with parts gpu, bench, cpu (default: gpu cpu); logs go to $OUT.
set -u
out=${OUT:-/tmp/d9d-gpu}; mkdir -p "$out"
parts=${*:-gpu cpu}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-flows/*.whl || exit 1
PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | tr '\n' ':')$PWD/flows/src
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DO_NOT_TRACK=1
nvidia-smi --query-gpu=name --format=csv,noheader; python3 --version; python3 -c "import torch; print('torch', torch.__version__)"
for m in core kernels states parallel pipeline metrics models peft flows flows.stages flows.pipeline; do
  python3 -c "import d9d.$m" && echo "import d9d.$m ok" || echo "import d9d.$m FAILED"
done
py="python3 -m pytest -q -p no:cacheprovider -rfE"
for part in $parts; do case $part in
  gpu)
    # A process that has initialised CUDA or run a backward cannot fork ranks that use CUDA or autograd, so: GPU
    # tests that fork NCCL ranks first, in their own process; then GPU tests that use CUDA in the pytest process.
    $py -m gpu --ignore tests/kernels --ignore tests/models 2>&1 | tee "$out/gpu-ranks.log" | tail -3
    $py -m gpu tests/kernels tests/models 2>&1 | tee "$out/gpu-local.log" | tail -3 ;;
  bench)
    # The anchor workloads through the Trainer: dense and MoE on 1 GPU, dense FSDP on 2 and 4 at the same per-GPU
    # batch (scaling efficiency = per-GPU tokens/s at N over at 1).
    gpus=$(nvidia-smi -L | wc -l)
    for cfg in "0 dense" "0 moe" "0,1 dense" "0,1,2,3 dense"; do set -- $cfg
      n=$(( $(echo "$1" | tr -cd , | wc -c) + 1 )); [ "$n" -le "$gpus" ] || continue
      CUDA_VISIBLE_DEVICES=$1 timeout 300 torchrun --nproc-per-node "$n" --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 bench/trainer_step.py --model "$2" 2>&1 | tee -a "$out/trainer_step.log" | grep "^[|#]"
    done ;;
  cpu)
    # The CPU suite with the GPUs hidden (as on CI).
    CUDA_VISIBLE_DEVICES= $py -m "not gpu and not isolated" 2>&1 | tee "$out/main.log" | tail -3
    CUDA_VISIBLE_DEVICES= $py -m isolated 2>&1 | tee "$out/isolated.log" | tail -3 ;;
  *) echo "unknown part $part (gpu, bench, cpu)"; exit 2 ;;
esac; done
