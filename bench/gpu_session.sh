#!/usr/bin/env bash
# One GPU session's benchmark runs, in parts that each fit one device call (10 minutes), on a 4-GPU host.
# Every part reruns its own baseline (FSDP at the same per-GPU batch) in the same command, since machines differ.
# Usage there (carry .whl): bash bench/gpu_session.sh PART...; logs and the printed tables go to $OUT.
#   parallel : tensor parallel vs FSDP (2 and 4 GPUs), expert parallel vs FSDP (1, 4 GPUs), long context (cp)
#   context  : every long-context row (cp=1, 2, 4 at 16k; cp=2, 4 at 32k; cp=1 at 8k)
#   nccltests: the NCCL tests of context attention and expert dispatch, failures in full
#   faults   : bench/faults.py's stage kinds on the CPUs, FAULT_PROCS campaigns in the background (call `wait` last)
#   scaling  : dense FSDP compiled on 1, 2, 4 GPUs;  ep2: MoE on 1 GPU, then FSDP-only and ep=2 on 2 GPUs
#   ep4      : MoE on 1 GPU, then FSDP-only, ep=4 and DeepEP on 4 GPUs (issue 15's goal rows)
#   ep4b     : ep4 with the same multi-tensor AdamW everywhere and both dense layouts under EP (design 0025)
#   ep4c     : ep4b after 0025's second round (host-derived dispatch plan, the LM head's reduce-scatter overlapped):
#              1 GPU; fsdp, ep with the dense layouts whole, split and kept, deep_ep whole; routing imbalance
#   ep4d     : design 0025's third round, compiled decoder layers (dispatch/combine eager): 1 GPU fsdp compiled; 4 GPUs
#              fsdp, ep whole and ep split compiled, then ep whole eager (ep4c's row) for comparison; ~8 minutes
#   ep4dtests: compiled EP against eager EP on NCCL (Inductor; all_to_all float32, deep_ep bf16 where installed)
#   ep4e     : issue 15 goal rows eager and compiled (--kernels loss): 1 GPU fsdp, then 4 GPUs fsdp and ep-whole
#   ep2c     : design 0029, the static-capacity exchange on 2 GPUs: its NCCL no-sync test, 1 GPU fsdp, then fsdp,
#              ep-whole (all-to-all) and ep_capacity-whole; compiled rows unless EP_COMPILED=0 (CAPACITY_FACTOR=2.0)
#   ep4c2    : ep2c's rows on 4 GPUs (the issue's goal size)
#   ep2g/ep4g: design 0031, CUDA-graphed steps: 1 GPU fsdp (layers, single) eager and single graphed; 4 GPUs fsdp,
#              then ep and ep_tokens (whole, replicate) eager; ep_tokens and ep_capacity replicated and graphed
#              (EP_COPY_FACTORS, default 2.0); then the NCCL parity tests of graphed EP against eager
#   kerneltests: GPU tests in the pytest process (kernels at real sizes, models); run after forking parts
#   compile  : tp2 x dp_shard2 with compiled layers, async TP off and on
#   pipeline : pipeline schedules at pp=4 (PIPE_SCHEDULES), one launch each
#   pipetests: the NCCL parity tests of every pipeline schedule (tests/pipeline/test_gpu_pipeline.py)
#   pipecomm : 1F1B, ZBV, DualPipeV with a 16k vocabulary at 4 rows per micro-batch (design 0026's check)
#   pipelinebal: pipeline schedules at pp=4 with balanced virtual-layer splits against even ones
#   pipecost : cost-aware ZBV (design 0027) against uniform-built ZBV, 1F1B and DualPipeV at their simulated-best
#              splits under the measured cost model, 4 rows per micro-batch (bench/pipeline_balance.py's table)
#   pipetrace: 1F1B and ZBV at 1 and 2 rows per micro-batch with a traced step per rank, then where each rank's
#              time goes (bench/pipeline_trace.py)
#   pipehost : host ms per F / I / W / B of ZBV's 5-layer stage, kernel ops dispatched vs called directly (1 GPU),
#              then cost-aware ZBV 4/3 and 1F1B 1/7 at PIPE_ROWS (default 4) with the ops dispatched (the old path),
#              then called directly (the default), on the same machine
#   pipegraphs: design 0028: cost-aware ZBV 4/3 and 1F1B 1/7 at PIPE_ROWS (default 4) on 4 GPUs, each eager and then
#              with --cuda-graphs (the compute actions replayed as CUDA graphs), on the same machine
#   pipemeasured: ZBV 4/3 and 1F1B 1/7 traced, replayed with their measured per-action GPU ms (and timed in-job by
#              measure_stage_costs, to compare); then ZBV and 1F1B planned with the implied cost model, with graphs
#   pipeschedules: 1F1B, interleaved 1F1B, ZBV and DualPipeV at pp=4 with CUDA graphs, planned and split under the
#              measured cost model (pipemeasured's)
#   pipememory: design note 0030: 1F1B, then ZBV with 1.0, 1.5, 2.0 x 1F1B's activation memory (measured costs, graphs)
#   pipedelays: 1F1B and ZBV 1.5x (graphs, measured costs) traced; each rank's lateness after its own previous action,
#              after a peer's input, outside the actions (bench/pipeline_trace.py --delays)
#   pipegraphs2: the same on 2 GPUs: ZBV and 1F1B at pp=2 with PIPE_LAYERS (default 16) layers, each split chosen by
#              simulation under the cost model (--suggest-split), eager then graphs
#   pipegraphstests: the GPU parity tests of the CUDA-graph executor against eager (tests/pipeline/test_gpu_cuda_graphs.py)
#   pipeline2: one stage's split backward against its full backward (ops, calls, host/device ms; 1 GPU), then
#              1F1B, ZBV and DualPipeV at pp=2 (2 GPUs), the anchor's 32 layers with 16 micro-batches
#   kernels  : the kernel table and the single-GPU Trainer ablation
#   generationtp: decoding under tp=2 (eager, compiled) next to one GPU, then the NCCL tp generation tests
#   ablation : bench/trainer_step.py --ablation dense, then moe (each lever alone, then all combined)
#   profile  : ablation rows (PROFILE_ROWS) with a Chrome trace each and its summary (where the step's time goes)
#   losscurve: bench/loss_curve.py, 200 steps of the baseline vs the combined configuration
#   hostwork : bench/step_host_overhead.py on one GPU (single, fsdp, replicate), each after its baseline when
#              HOSTWORK_BASELINE names a folder holding an older `packages/` tree; then this change's GPU tests
#   fusedloss: the fused loss with gradients in forward (design 0023): kernel rows at chunks 2048 and 4096, its
#              GPU tests, then dense ablation rows 7 (in forward), 13 (recomputed in backward: the old path), 14
#              (chunk 4096)
#   deepep   : build DeepEP in the background (its own session, so it outlives the call), then test it
set -u
out=${OUT:-/tmp/d9d-gpu}; mkdir -p "$out"
# numpy and psutil travel for the fault campaign only, installed there if the image lacks them
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v -e /numpy- -e /psutil-) || exit 1
PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | tr '\n' ':')$PWD/flows/src
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DO_NOT_TRACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader | uniq -c
run() {  # run GPUS TIMEOUT LOG ARGS...: one torchrun on the listed GPUs, tables (lines starting | or #) echoed
  local gpus=$1 limit=$2 log=$3; shift 3
  local n=$(( $(echo "$gpus" | tr -cd , | wc -c) + 1 ))
  echo "## $(date -u +%H:%M:%S) gpus=$gpus $*" | tee -a "$out/$log"
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" torchrun --nproc-per-node "$n" --rdzv-backend c10d \
    --rdzv-endpoint localhost:0 "$@" 2>&1 | tee -a "$out/$log" | grep -E "^[|#{]" | cut -c1-400
}
for part in "$@"; do case $part in
  parallel)
    B=bench/tensor_parallel.py
    run 0,1 120 tp.log $B --steps 8 --warmup 3
    run 0,1 120 tp.log $B --tp 2 --steps 8 --warmup 3
    run 0,1,2,3 120 tp.log $B --steps 8 --warmup 3
    run 0,1,2,3 120 tp.log $B --tp 2 --steps 8 --warmup 3
    E=bench/expert_parallel.py
    run 0 90 ep.log $E --modes fsdp --steps 8 --warmup 3 --profile-steps 2 --budget-seconds 80
    run 0,1,2,3 150 ep.log $E --modes fsdp ep deep_ep --steps 8 --warmup 3 --profile-steps 2 --budget-seconds 140
    C=bench/context_parallel.py
    run 0 90 cp.log $C --cp 1 --seq 8192
    run 0 90 cp.log $C --cp 1 --seq 16384
    run 0,1,2,3 120 cp.log $C --cp 4 --seq 16384
    run 0,1,2,3 120 cp.log $C --cp 4 --seq 32768 ;;
  context)  # every cp row of issue 14, cp=1 baselines first
    C=bench/context_parallel.py
    run 0 90 cp.log $C --cp 1 --seq 8192
    run 0 90 cp.log $C --cp 1 --seq 16384
    run 0,1 100 cp.log $C --cp 2 --seq 16384
    run 0,1,2,3 100 cp.log $C --cp 4 --seq 16384
    run 0,1 100 cp.log $C --cp 2 --seq 32768
    run 0,1,2,3 100 cp.log $C --cp 4 --seq 32768 ;;
  nccltests)  # the NCCL parity tests of context attention and expert dispatch, with their failure text
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
      tests/parallel/test_gpu_context_attention.py tests/parallel/test_gpu_expert_dispatch.py 2>&1 \
      | tee "$out/nccl-tests.log" | tail -60 | cut -c1-300 ;;
  faults)  # the fault campaign's stage kinds on the host's idle CPUs, in the background while later parts use GPUs
    python3 -c "import psutil, numpy" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site \
      .whl/psutil-*.whl .whl/numpy-*.whl
    seed0=${FAULT_SEED0:-41}
    for seed in $(seq "$seed0" $(( seed0 + ${FAULT_PROCS:-8} - 1 ))); do
      CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout "${FAULT_SECONDS:-480}" python3 bench/faults.py \
        --trials "${FAULT_TRIALS:-6}" --seed "$seed" --json "$out/faults-$seed.json" > "$out/faults-$seed.log" 2>&1 &
    done ;;
  scaling)  # issue 21's FSDP scaling on the GPUs lent (1, 2, 4), compiled, same per-GPU batch
    for gpus in 0 0,1 0,1,2,3; do run $gpus 80 scaling.log bench/tensor_parallel.py --compile --steps 6 --warmup 2; done ;;
  ep2)  # the MoE anchor: the 1-GPU figure, then FSDP-only, ep=2 and DeepEP (where installed) on 2 GPUs; each row
        # prints before its profile, and a profile that would not fit the call's time is skipped
    E=bench/expert_parallel.py
    run 0 120 ep.log $E --modes fsdp --steps 8 --warmup 3 --profile-steps 2 --budget-seconds 105 --trace-dir "$out/traces"
    run 0,1 ${EP_SECONDS:-240} ep.log $E --modes fsdp ep deep_ep --steps 8 --warmup 3 --profile-steps 2 \
      --budget-seconds $(( ${EP_SECONDS:-240} - 15 )) --trace-dir "$out/traces" ;;
  ep4b)  # issue 15 after design 0025: the 1-GPU figure, then FSDP-only, ep=4 with the dense layouts `layers` (per-layer
         # units, as ep4) and `whole` (one unit, no reshard), DeepEP likewise where installed; every row with the same
         # multi-tensor AdamW; then each trace's summary (GPU busy/idle, largest gaps, kernel families). ~7 minutes.
    E=bench/expert_parallel.py
    run 0 100 ep.log $E --modes fsdp --steps 8 --warmup 3 --profile-steps 2 --budget-seconds 85 --trace-dir "$out/traces"
    run 0,1,2,3 ${EP_SECONDS:-300} ep.log $E --modes fsdp ep deep_ep --dense-layouts layers whole --steps 8 --warmup 3 \
      --profile-steps 2 --budget-seconds $(( ${EP_SECONDS:-300} - 15 )) --trace-dir "$out/traces"
    for trace in "$out"/traces/expert_parallel-*.json.gz; do
      echo "## $(basename "$trace")"
      timeout 20 python3 bench/trace_summary.py "$trace" --top 6 --gap-ms 2 > "${trace%.json.gz}.summary.txt" 2>&1
      head -14 "${trace%.json.gz}.summary.txt" | cut -c1-200
    done ;;
  ep4c)  # issue 15, design 0025's second round: the 1-GPU figure, then FSDP-only, ep=4 with the dense layouts
         # `whole` (as ep4b), `split` (the LM head its own unit) and `kept` (per-layer units, no reshard), DeepEP with
         # `whole`; each ep row prints the rows received per rank per MoE layer (max/mean); then the trace summaries.
         # First the NCCL identity test of the all-to-all dispatcher (its CUDA-only pinned-copy path). ~7.5 minutes.
    timeout 45 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/parallel/test_gpu_expert_dispatch.py \
      -k all_to_all 2>&1 | tail -4
    E=bench/expert_parallel.py
    run 0 100 ep.log $E --modes fsdp --steps 8 --warmup 3 --profile-steps 2 --budget-seconds 85 --trace-dir "$out/traces"
    run 0,1,2,3 ${EP_SECONDS:-270} ep.log $E --modes fsdp ep deep_ep --dense-layouts whole split kept \
      --deep-ep-layouts whole --steps 8 --warmup 3 --profile-steps 2 --budget-seconds $(( ${EP_SECONDS:-270} - 15 )) \
      --trace-dir "$out/traces"
    for trace in "$out"/traces/expert_parallel-*.json.gz; do
      echo "## $(basename "$trace")"
      timeout 15 python3 bench/trace_summary.py "$trace" --top 6 --gap-ms 2 > "${trace%.json.gz}.summary.txt" 2>&1
      head -14 "${trace%.json.gz}.summary.txt" | cut -c1-200
    done ;;
  ep4d)  # issue 15, design 0025's third round: every decoder layer compiled (Inductor), each MoE layer's dispatch,
         # experts and combine eager (one graph break per layer). The 1-GPU fsdp figure compiled, then on 4 GPUs fsdp,
         # ep-whole and ep-split compiled, then the eager ep-whole row of ep4c in the same call; the two ep-whole traces
         # summarised. Compilation runs in the first warm-up step (warm-up 4: three warm steps before timing); each
         # budget skips a profile that would not fit. EP4D_ARGS adds options to the compiled runs (e.g. --kernels
         # loss). At most 130 + 230 + 80 + 2 x 15 s, about 8 minutes.
    E=bench/expert_parallel.py
    run 0 130 ep.log $E --modes fsdp --compile-layers ${EP4D_ARGS:-} --steps 8 --warmup 4 --profile-steps 2 \
      --budget-seconds 115 --trace-dir "$out/traces"
    run 0,1,2,3 230 ep.log $E --modes fsdp ep --dense-layouts whole split --compile-layers ${EP4D_ARGS:-} --steps 8 \
      --warmup 4 --profile-steps 2 --budget-seconds 215 --trace-dir "$out/traces"
    run 0,1,2,3 80 ep.log $E --modes ep --dense-layouts whole --steps 8 --warmup 3 --profile-steps 2 \
      --budget-seconds 65 --trace-dir "$out/traces"
    for label in ep-whole-compiled ep-whole; do
      trace="$out/traces/expert_parallel-$label-4gpu.json.gz"
      [ -f "$trace" ] || continue
      echo "## $(basename "$trace")"
      timeout 15 python3 bench/trace_summary.py "$trace" --top 6 --gap-ms 2 > "${trace%.json.gz}.summary.txt" 2>&1
      head -14 "${trace%.json.gz}.summary.txt" | cut -c1-200
    done ;;
  ep4e)  # issue 15's goal rows in one call, eager and compiled: the 1-GPU fsdp figure, then fsdp and ep-whole on 4
         # GPUs; compiled rows with --kernels loss (eager norms/SwiGLU/RoPE/permutation for Inductor to fuse: the Triton
         # kernels are opaque custom ops to it). At most 90 + 110 + 110 + 160 s, about 8 minutes; usually 5.
    E=bench/expert_parallel.py
    run 0 90 ep.log $E --modes fsdp --steps 8 --warmup 3 --profile-steps 2 --budget-seconds 75
    run 0 110 ep.log $E --modes fsdp --compile-layers --kernels loss --steps 8 --warmup 4 --profile-steps 2 \
      --budget-seconds 95
    run 0,1,2,3 110 ep.log $E --modes fsdp ep --dense-layouts whole --steps 8 --warmup 3 --profile-steps 2 \
      --budget-seconds 95
    run 0,1,2,3 160 ep.log $E --modes fsdp ep --dense-layouts whole --compile-layers --kernels loss --steps 8 \
      --warmup 4 --profile-steps 2 --budget-seconds 145 ;;
  ep2c|ep4c2)  # design 0029: the sync-free static-capacity exchange (ep_capacity) beside the all-to-all (ep), both with
         # the dense layout `whole`, after the 1-GPU figure and FSDP-only on the same GPUs; then the same compiled
         # (--kernels loss). Eager about 3 minutes on 2 GPUs, compiled rows about 3 more. EP_STEPS picks what runs
         # (default "tests eager compiled"), so the rows can share calls with other parts.
    E=bench/expert_parallel.py; gpus=0,1; [ "$part" = ep4c2 ] && gpus=0,1,2,3
    cf=${CAPACITY_FACTOR:-2.0}; steps=" ${EP_STEPS:-tests eager compiled} "
    if [[ $steps == *" tests "* ]]; then
      timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
        tests/parallel/test_gpu_expert_dispatch_capacity.py 2>&1 | tee "$out/$part-tests.log" | tail -20 | cut -c1-300
    fi
    if [[ $steps == *" eager "* ]]; then
      run 0 90 ep.log $E --modes fsdp --steps 8 --warmup 3 --profile-steps 0
      run $gpus 150 ep.log $E --modes fsdp ep ep_capacity --dense-layouts whole --capacity-factor "$cf" --steps 8 \
        --warmup 3 --profile-steps 2 --budget-seconds 135
    fi
    if [[ $steps == *" compiled "* ]]; then
      run 0 110 ep.log $E --modes fsdp --compile-layers --kernels loss --steps 8 --warmup 4 --profile-steps 0
      run $gpus 200 ep.log $E --modes fsdp ep ep_capacity --dense-layouts whole --capacity-factor "$cf" \
        --compile-layers --kernels loss --steps 8 --warmup 4 --profile-steps 2 --budget-seconds 185
    fi ;;
  ep2g|ep4g)  # design 0031: forward, backward and gradient all-reduce replayed as one CUDA graph; baselines first.
         # EP_STEPS picks what runs (default "single eager graphed tests"); EP_COPY_FACTORS the tokens' row
         # capacities (a graphed run each, default 2.0), EP_GRAPH_MODES the graphed modes.
    E=bench/expert_parallel.py; gpus=0,1; [ "$part" = ep4g ] && gpus=0,1,2,3
    steps=" ${EP_STEPS:-single eager graphed tests} "
    if [[ $steps == *" single "* ]]; then
      run 0 150 ep.log $E --modes fsdp --fsdp-layouts layers single --steps 8 --warmup 3 --profile-steps 0
      run 0 90 ep.log $E --modes fsdp --fsdp-layouts single --cuda-graph --steps 8 --warmup 3 --profile-steps 0
    fi
    if [[ $steps == *" eager "* ]]; then
      run $gpus 150 ep.log $E --modes fsdp ep ep_tokens --dense-layouts whole replicate --steps 8 --warmup 3 \
        --profile-steps 0
    fi
    if [[ $steps == *" baseline "* ]]; then
      run $gpus 90 ep.log $E --modes fsdp --steps 8 --warmup 3 --profile-steps 0
    fi
    if [[ $steps == *" graphed "* ]]; then
      for cf in ${EP_COPY_FACTORS:-2.0}; do
        run $gpus 150 ep.log $E --modes ${EP_GRAPH_MODES:-ep_tokens ep_capacity} --dense-layouts replicate \
          --cuda-graph --copy-capacity-factor "$cf" --steps 8 --warmup 3 --profile-steps "${EP_PROFILE_STEPS:-1}" \
          --budget-seconds 140 --trace-dir "$out/traces"
      done
    fi
    if [[ $steps == *" tests "* ]]; then
      D9D_GPU_TEST_TIMEOUT=130 timeout -s INT 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
        tests/models/test_gpu_cuda_graphed_step.py 2>&1 | tee "$out/ep4g-tests.log" \
        | grep -E "passed|failed|Error|File|Thread" | head -60 | cut -c1-300
    fi ;;
  ep4dtests)  # compiled decoder layers under EP on NCCL against the same run eager, no recompilation after step 1
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu \
      tests/models/test_gpu_expert_parallel_compiled.py 2>&1 | tee "$out/ep4d-tests.log" | tail -40 | cut -c1-300 ;;
  ep4)  # issue 15's goal rows: the MoE anchor's 1-GPU figure, then FSDP-only, ep=4 and DeepEP on 4 GPUs
    E=bench/expert_parallel.py
    run 0 100 ep.log $E --modes fsdp --steps 8 --warmup 3 --profile-steps 2 --budget-seconds 85 --trace-dir "$out/traces"
    run 0,1,2,3 ${EP_SECONDS:-200} ep.log $E --modes fsdp ep deep_ep --steps 8 --warmup 3 --profile-steps 2 \
      --budget-seconds $(( ${EP_SECONDS:-200} - 15 )) --trace-dir "$out/traces" ;;
  kerneltests)  # GPU tests that use CUDA in the pytest process (after every forking test)
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m gpu tests/kernels tests/models 2>&1 \
      | tee "$out/kernel-tests.log" | tail -25 | cut -c1-300 ;;
  compile)  # compiled FSDP baselines, compiled tp=2, compiled tp=2 with async TP; 2 then 4 GPUs
    B=bench/tensor_parallel.py
    for gpus in 0,1 0,1,2,3; do
      run $gpus 85 tp.log $B --compile --steps 8 --warmup 3
      run $gpus 85 tp.log $B --tp 2 --compile --steps 8 --warmup 3
      run $gpus 85 tp.log $B --tp 2 --compile --async-tp --steps 8 --warmup 3
    done ;;
  pipeline)
    # One launch per schedule so that one failure keeps the others' rows (PIPE_SCHEDULES picks them and their order).
    for schedule in ${PIPE_SCHEDULES:-1f1b interleaved_1f1b zbv dualpipe_v}; do
      run 0,1,2,3 ${PIPE_SECONDS:-100} pp.log bench/pipeline_schedules.py --schedules $schedule --steps 5 --warmup 2 \
        --profile-steps 1
    done ;;
  pipetests)  # the NCCL parity tests of every schedule (pp=world; pp2 x tp2, pp2 x cp2 on 4 GPUs), failures in full
    # Each test's ranks get D9D_GPU_TEST_TIMEOUT seconds (a test takes about 20 s), so a hang reports every rank's
    # stack well inside the part's limit; -v names each test as it finishes.
    D9D_GPU_TEST_TIMEOUT=${D9D_GPU_TEST_TIMEOUT:-120} timeout ${PIPE_TEST_SECONDS:-420} python3 -m pytest -v \
      -p no:cacheprovider -rfE --tb=short -m gpu tests/pipeline/test_gpu_pipeline.py 2>&1 \
      | tee "$out/pipeline-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -60 | cut -c1-300 ;;
  pipecomm)  # design 0026: 1F1B, ZBV and DualPipeV with a 16k vocabulary (the head about one layer), 4 rows per
             # micro-batch, even split: measured against simulated bubble with the two communicators per pipeline
    for schedule in ${PIPE_SCHEDULES:-1f1b zbv dualpipe_v}; do
      run 0,1,2,3 ${PIPE_SECONDS:-90} pp.log bench/pipeline_schedules.py --schedules $schedule --vocab-size 16384 \
        --microbatch-rows 4 --head-cost-layers 1 --steps 5 --warmup 2 --profile-steps 1
    done ;;
  pipelinebal)  # issue 16: balanced splits (virtual layers for the embedding and the head) against even ones; the
                # compute-only measured bubble beside the earlier one; PIPE_ROWS rows per micro-batch (default 1)
    # PIPE_SPLITS: "schedule pre post" triples; HEAD_COST: the head's cost in layers for the stage-cost simulation
    IFS=, read -r -a splits <<< "${PIPE_SPLITS:-1f1b 0 3,zbv 1 3,dualpipe_v 1 3,1f1b 0 0,zbv 0 0}"
    for split in "${splits[@]}"; do
      set -- $split
      run 0,1,2,3 ${PIPE_SECONDS:-100} pp.log bench/pipeline_schedules.py --schedules $1 --virtual-layers-pre $2 \
        --virtual-layers-post $3 --microbatch-rows ${PIPE_ROWS:-1} --head-cost-layers ${HEAD_COST:-4} --steps 5 \
        --warmup 2 --profile-steps 1
    done ;;
  pipecost)  # issue 16, design 0027: builders planned with the measured cost model (head F 5.3 I 17.8 W 0, embedding
             # W 0.3, layer 1/1/1); PIPE_COST_RUNS: "schedule pre post costs" where costs is 1 (cost model) or 0
    python3 bench/pipeline_balance.py | tee -a "$out/pp.log"
    IFS=, read -r -a runs <<< "${PIPE_COST_RUNS:-zbv 4 3 1,zbv 4 4 0,1f1b 1 7 1,1f1b 0 7 1,dualpipe_v 4 3 1}"
    for item in "${runs[@]}"; do
      set -- $item
      costs=(); [ "$4" = 1 ] && costs=(--head-costs 5.3 17.8 0 --embedding-costs 0 0 0.3)
      run 0,1,2,3 ${PIPE_SECONDS:-100} pp.log bench/pipeline_schedules.py --schedules $1 --virtual-layers-pre $2 \
        --virtual-layers-post $3 --microbatch-rows ${PIPE_ROWS:-4} --steps 5 --warmup 2 --profile-steps 1 "${costs[@]}"
    done ;;
  pipetrace)  # issue 16: 1F1B and ZBV (even split) at PIPE_ROWS_LIST rows per micro-batch, one traced step per rank
              # each, then bench/pipeline_trace.py: per rank compute, waiting on a peer, starved, host per action
    for rows in ${PIPE_ROWS_LIST:-1 2}; do
      for schedule in ${PIPE_SCHEDULES:-1f1b zbv}; do
        run 0,1,2,3 ${PIPE_SECONDS:-80} pp.log bench/pipeline_schedules.py --schedules $schedule --microbatch-rows $rows \
          --steps 5 --warmup 2 --profile-steps 1 --trace-dir "$out/pptraces"
      done
    done
    python3 bench/pipeline_trace.py "$out/pptraces" | tee -a "$out/pp.log" ;;
  pipehost)  # host work per action (bench/pipeline_host_overhead.py), then the pipecost rows with both call modes
    for rows in 1 4; do run 0 120 pphost.log bench/pipeline_host_overhead.py --layers 5 --rows $rows --repeats 10; done
    for mode in dispatch direct; do
      for item in "zbv 4 3" "1f1b 1 7"; do
        set -- $item
        echo "## D9D_KERNEL_OP_CALLS=$mode" | tee -a "$out/pphost.log"
        D9D_KERNEL_OP_CALLS=$mode run 0,1,2,3 ${PIPE_SECONDS:-100} pphost.log bench/pipeline_schedules.py \
          --schedules $1 --virtual-layers-pre $2 --virtual-layers-post $3 --microbatch-rows ${PIPE_ROWS:-4} --steps 5 \
          --warmup 2 --profile-steps 1 --head-costs 5.3 17.8 0 --embedding-costs 0 0 0.3
      done
    done ;;
  pipegraphs)  # design 0028: pipehost's second half (cost-aware ZBV 4/3, 1F1B 1/7), eager then CUDA graphs
    for item in "zbv 4 3" "1f1b 1 7"; do
      set -- $item
      for graphs in "" --cuda-graphs; do
        run 0,1,2,3 ${PIPE_SECONDS:-120} ppgraphs.log bench/pipeline_schedules.py --schedules $1 --virtual-layers-pre $2 \
          --virtual-layers-post $3 --microbatch-rows ${PIPE_ROWS:-4} --steps 5 --warmup 2 --profile-steps 1 \
          --head-costs 5.3 17.8 0 --embedding-costs 0 0 0.3 $graphs
      done
    done ;;
  pipemeasured)  # issue 16: cost-aware ZBV 4/3 traced eagerly, its program replayed with every stage's measured GPU
    # ms per action (column `simulated, measured costs`), the cost model those measurements imply; then ZBV and 1F1B
    # planned with that model (--suggest-split), with CUDA graphs
    pp=bench/pipeline_schedules.py; common="--microbatch-rows ${PIPE_ROWS:-4} --warmup 2 --embedding-costs 0 0 0.3"
    for item in "zbv 4 3" "1f1b 1 7"; do
      set -- $item
      run 0,1,2,3 ${PIPE_SECONDS:-120} ppmeasured.log $pp --schedules $1 --virtual-layers-pre $2 --virtual-layers-post $3 \
        --head-costs 5.3 17.8 0 $common --steps 3 --profile-steps 1 --trace-dir "$out/pptraces" --measure-costs
    done
    measured=$(grep -o "zbv: measured cost model .*" "$out/ppmeasured.log" | tail -1 | sed 's/.*cost model //')
    echo "## measured cost model: ${measured:-none}" | tee -a "$out/ppmeasured.log"
    if [ -n "$measured" ]; then
      for schedule in zbv 1f1b; do
        run 0,1,2,3 ${PIPE_SECONDS:-120} ppmeasured.log $pp --schedules $schedule --suggest-split $common $measured \
          --steps 5 --profile-steps 1 --cuda-graphs
      done
    fi ;;
  pipeschedules)  # issue 16's table: every pp=4 schedule at PIPE_ROWS rows with CUDA graphs, each planned and split
    # (--suggest-split) under the cost model measured with CUDA graphs on 4 x H200 in session 13 (PIPE_COSTS overrides it)
    costs=${PIPE_COSTS:---layer-costs 1.00 2.00 0.43 --head-costs 5.94 15.93 0.06 --embedding-costs 0.23 0.00 0.89}
    for schedule in ${PIPE_SCHEDULES:-1f1b interleaved_1f1b zbv dualpipe_v}; do
      run 0,1,2,3 ${PIPE_SECONDS:-120} ppschedules.log bench/pipeline_schedules.py --schedules $schedule --suggest-split \
        --microbatch-rows ${PIPE_ROWS:-4} --warmup 2 --steps 5 --profile-steps 1 --cuda-graphs $costs
    done ;;
  pipememory)  # design note 0030: ZBV planned under the measured cost model with 1.0, 1.5 and 2.0 times 1F1B's
    # activation memory, after the 1F1B baseline, all with CUDA graphs and each split by simulation
    costs=${PIPE_COSTS:---layer-costs 1.00 2.00 0.43 --head-costs 5.94 15.93 0.06 --embedding-costs 0.23 0.00 0.89}
    IFS=, read -ra items <<< "1f1b 1,${PIPE_MEMORY_RUNS:-zbv 1,zbv 1.5,zbv 2}"  # "schedule memory" pairs
    for item in "${items[@]}"; do
      set -- $item
      run 0,1,2,3 ${PIPE_SECONDS:-120} ppmemory.log bench/pipeline_schedules.py --schedules $1 --activation-memory $2 \
        --suggest-split --microbatch-rows ${PIPE_ROWS:-4} --warmup 2 --steps 5 --profile-steps 1 --cuda-graphs $costs
    done ;;
  pipedelays)  # issue 16: where the runtime's share of the bubble goes: 1F1B and ZBV (PIPE_MEMORY, default 1.5x
    # activation memory) planned under the measured cost model with CUDA graphs, one traced step per rank; rank 0
    # prints each rank's lateness after its own previous action, after a peer's input, and outside the actions
    costs=${PIPE_COSTS:---layer-costs 1.00 2.00 0.43 --head-costs 5.94 15.93 0.06 --embedding-costs 0.23 0.00 0.89}
    for item in "1f1b 1" "zbv ${PIPE_MEMORY:-1.5}"; do
      set -- $item
      run 0,1,2,3 ${PIPE_SECONDS:-120} ppdelays.log bench/pipeline_schedules.py --schedules $1 --activation-memory $2 \
        --suggest-split --microbatch-rows ${PIPE_ROWS:-4} --warmup 2 --steps 5 --profile-steps 1 --cuda-graphs $costs \
        --trace-dir "$out/pptraces" ${PIPE_EXTRA:-}
    done
    (cd "$out" && tar czf pptraces.tgz pptraces && rm -rf pptraces) ;;
  pipegraphs2)  # the same at pp=2 on 2 GPUs (PIPE_LAYERS layers; the anchor's head at 16 layers is about a third)
    # (the split per schedule by simulation under the cost model: --suggest-split)
    for schedule in zbv 1f1b; do
      for graphs in "" --cuda-graphs; do
        run 0,1 ${PIPE_SECONDS:-120} ppgraphs2.log bench/pipeline_schedules.py --schedules $schedule --suggest-split \
          --num-layers ${PIPE_LAYERS:-16} --microbatch-rows ${PIPE_ROWS:-4} --steps ${PIPE_STEPS:-5} --warmup 2 \
          --profile-steps 1 --head-costs 5.3 17.8 0 --embedding-costs 0 0 0.3 $graphs
      done
    done ;;
  pipegraphstests)
    D9D_GPU_TEST_TIMEOUT=400 timeout -s INT 450 python3 -m pytest -v -s -p no:cacheprovider -rfE -m gpu \
      tests/pipeline/test_gpu_cuda_graphs.py 2>&1 | tee "$out/pipegraphs-tests.log" \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|graphs vs eager" | cut -c1-300 ;;
  pipeline2)
    for layers in 8 4; do run 0 100 pp2.log bench/pipeline_split_backward.py --layers $layers; done
    for schedule in 1f1b zbv dualpipe_v; do
      run 0,1 ${PIPE_SECONDS:-120} pp2.log bench/pipeline_schedules.py --schedules $schedule --steps 5 --warmup 2 \
        --profile-steps 1
    done ;;
  gputests)
    timeout 150 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/parallel tests/pipeline 2>&1 \
      | tee "$out/gpu-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | cut -c1-200 ;;
  generation)
    timeout 470 python3 bench/generation.py 2>&1 | tee "$out/generation.log" | grep -E "^[|#]" ;;
  generationtp)
    run 0,1 240 generation-tp.log bench/generation_tp.py
    run 0,1 240 generation-tp.log bench/generation_tp.py --compile
    timeout 100 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/models/test_gpu_generation_tensor_parallel.py \
      2>&1 | tee "$out/generation-tp-tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | cut -c1-200 ;;
  kernels)
    timeout 200 python3 bench/kernels.py --json "$out/kernels.json" 2>&1 | tee "$out/kernels.log" | grep -E "^[|#]"
    for flags in "--kernels eager" "--kernels triton" "--kernels triton --compile"; do
      run 0 120 trainer.log bench/trainer_step.py --model dense $flags; done
    for flags in "--kernels eager" "--kernels triton"; do
      run 0 100 trainer.log bench/trainer_step.py --model moe $flags; done ;;
  ablation)  # the single-GPU levers of issue 17, rows back to back per model (ABLATION_ROWS=0,3,6 picks rows)
    for model in ${ABLATION_MODELS:-dense moe}; do
      run 0 ${ABLATION_SECONDS:-290} ablation.log bench/trainer_step.py --ablation $model \
        ${ABLATION_ROWS:+--rows $ABLATION_ROWS}; done ;;
  profile)  # ablation rows with a 2-step Chrome trace each, summarised by bench/trace_summary.py (PROFILE_ROWS=0,7)
    for model in ${ABLATION_MODELS:-dense}; do
      run 0 ${ABLATION_SECONDS:-400} ablation.log bench/trainer_step.py --ablation $model --rows ${PROFILE_ROWS:-0,7} \
        --profile /tmp/prof-$model
      for trace in /tmp/prof-$model/row-*/rank-00000/*.json; do row=$(basename "$(dirname "$(dirname "$trace")")")
        python3 bench/trace_summary.py "$trace" --top 20 > "$out/summary-$model-$row.txt"
        echo "== $model $row"; sed -n '1,4p;/by family/,/^$/p' "$out/summary-$model-$row.txt"; done; done ;;
  fusedloss)
    timeout 130 python3 bench/kernels.py --only linear --loss-chunks 2048,4096 2>&1 | tee "$out/fusedloss-kernels.log" \
      | grep -E "^[|#]"
    timeout 140 python3 -m pytest -q -s -p no:cacheprovider -rfE --tb=short -m gpu tests/kernels/test_gpu_triton.py \
      -k "cross_entropy or accumulation" 2>&1 | tee "$out/fusedloss-tests.log" | tail -12 | cut -c1-300
    run 0 ${ABLATION_SECONDS:-300} ablation.log bench/trainer_step.py --ablation dense --rows 7,13,14 ;;
  losscurve)  # 200 steps of the baseline and the "all" row (LOSS_ROW=index), max relative loss-curve deviation
    for model in ${LOSS_MODELS:-dense}; do
      run 0 ${LOSS_SECONDS:-290} losscurve.log bench/loss_curve.py --model $model --fast ${LOSS_ROW:-6}; done ;;
  hostwork)  # the step's host work outside forward/backward; baseline: HOSTWORK_BASELINE=.baseline, made beforehand
    # with `git archive <commit> packages | tar -x -C .baseline` in the repository (untracked, so it travels)
    for dp in single fsdp replicate; do
      if [ -n "${HOSTWORK_BASELINE:-}" ]; then
        echo "# baseline: $HOSTWORK_BASELINE"
        PYTHONPATH=/tmp/site:$(ls -d "$PWD/$HOSTWORK_BASELINE"/packages/*/src | tr '\n' ':')$PWD/flows/src \
          run 0 120 hostwork.log bench/step_host_overhead.py --device cuda --data-parallel $dp
      fi
      run 0 120 hostwork.log bench/step_host_overhead.py --device cuda --data-parallel $dp; done
    python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/core/test_gpu_nccl.py tests/parallel/test_gpu_grad_norm.py \
      2>&1 | tail -8 ;;
  deepep)
    if [ -f /tmp/deepep.done ]; then tail -20 /tmp/deepep.log; cp /tmp/deepep.log "$out/"
      python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/parallel/test_gpu_expert_dispatch.py 2>&1 | tail -8
    elif pgrep -f build_deepep.sh >/dev/null; then echo "deepep build still running"; tail -3 /tmp/deepep.log
    else MAX_JOBS=24 PYTHON=python3 DEEP_EP_LOG_DIR=/tmp DEEP_EP_ATTEMPTS=${DEEP_EP_ATTEMPTS:-"1 2"} setsid nohup bash -c \
        'nice bash bench/build_deepep.sh; touch /tmp/deepep.done' > /tmp/deepep.log 2>&1 < /dev/null &
      echo "deepep build started"; fi ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
