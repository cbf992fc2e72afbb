#!/usr/bin/env bash
# The GPU runs, by section, in lanes: each lane is a set of GPUs running its sections one after another,
# and lanes run side by side (a 4-GPU host runs two 2-GPU lanes at once, or one 4-GPU lane).
#
#   bash benchmarks/gpu_suite.sh OUT COMMIT LANE [LANE ...]      LANE = GPUS:SECTION[,SECTION...]
#   e.g. bash benchmarks/gpu_suite.sh $OUT abc1234 0,1:tests,e2e_balanced 2,3:checkpoint,train1b
#
# Sections: tests (GPU tests; 2- and 4-GPU ones where the lane has them, the copy-engine gather's 2-GPU ones
# left to tests_copy_engine), tests_rest (the GPU tests after them: parking, split_masters, ...), tests_four (the tests that need 4 GPUs alone: on a 4-GPU lane `tests` runs some
# 94 tests, more than its limit holds, whose 2-GPU ones a 2-GPU lane runs), tests_copy_engine (issue 31's copy-engine hang taken apart: the gather with and
# without its side streams, each case bounded), fully_shard (issues 34, 42: tests/test_gpu_fully_shard.py, a
# torchtitan-style script through torch's fully_shard and ours, uneven counts against one process, a CPU-built model
# moved to the CUDA mesh), trl (issue 42 item 6: tests/test_gpu_trl.py, TRL's SFTTrainer through accelerate's FSDP2
# plugin on torch's fully_shard and, after odcfsdp.patch_fsdp2, on ours, 5 steps to 1e-5; needs trl and datasets,
# carried as wheels: skipped without them), comm, optim, park (issue 41 item 4: the parked optimizer state's copies
# against the host link; one GPU is enough for these two), park_backward (issue 41 item 4 on one GPU: the parked state
# brought back under the last backward against after it),
# checkpoint, train1b, e2e_balanced, e2e_balanced_8b, e2e_longtail, e2e_longtail_8b, memory_8b_balanced,
# memory_8b_longtail, best_fit_1b, best_fit_8b_balanced_odc, best_fit_8b_balanced_fsdp2, best_fit_8b_longtail_odc,
# best_fit_8b_longtail_fsdp2 (issue 23's search split to fit one call each; merge them with
# python -m benchmarks.best_fit --merge), hf_8b_balanced, hf_8b_longtail (the HF Llama-3.1-8B shape: odc vs hf_fsdp2),
# hf_1b_vs_llama_1b (HF Llama-3.2-1B shape vs our 1B, same workload, one call; fits one GPU),
# hf_finetune_longtail (the CLI on long-tailed chats next to the e2e bench's odc run of the same model;
# fits one GPU), sim_heldout_8b (issue 31: the step simulator's next held-out 8B run, another seed and 2 samples
# per GPU), tests_float8 (issue 35: float8 against torchao + FSDP2 float8 over 200 steps, bf16 rows gathered, and
# in a test of its own float8 ones, float8_gather; one GPU of compute capability 8.9+, torchao carried as a wheel; and the CPU float8
# tests, the float8 gather's among them), fp8_1gpu (issue 35: benchmarks/fp8_bench.py, 8B-shaped layers on one
# GPU: bf16, float8 tensorwise and rowwise, tensorwise with float8_gather, torchao + FSDP2 float8), fp8_8b_balanced
# (issue 35: the 8B model, odc float8 gathering float8 rows, --float8-gather, against
# FSDP2 with torchao's float8 all-gather, in one call, with memory, each method in its own processes; 2+ GPUs),
# fp8_8b_balanced_lean (the same for odc with gather_masters: no bf16 rows), levers_8b_balanced, levers_8b_longtail
# (issue 41: FSDP2, odc's default and odc with each memory lever, isolated, with the peak by category), tests_eight,
# n8_8b_longtail, n8_14b_longtail, n8_8b_balanced, n8_hsdp_8b_longtail (issue 45 on one 8-GPU host: HSDP parity,
# long-tailed 8B and 14B, balanced 8B, HSDP 2 x 4; the simulator's predictions in results/sim/predict_n8_*). Results go to
# OUT/<section>_n<GPUs>/; each lane is packed into
# OUT/lane<k>.tar.gz after every section (the device tool returns few files, and a run cut off by its
# time limit keeps what finished). Every section has a time limit (SECTION_TIMEOUT_<section>, seconds)
# and a lane goes on after a failed section. Extra arguments for a section: ARGS_<section>.
# Needs python3 with torch/triton, and nvshmem4py + hydra on PYTHONPATH; the scripts run as modules
# (python3 -m benchmarks.<name>), this checkout's root put first on PYTHONPATH.
# Tests sections cannot hang a call ([bounded-spawn] in odcfsdp/launch/processes.py): every spawn is bounded (90 s for NCCL
# ranks unless a test says otherwise), with the ranks' own guards firing first and their stacks in the error;
# every test is bounded by pytest-timeout (--timeout); and each test's outcome is appended to outcomes.jsonl as it
# ends, so a section cut off by its limit still says what passed, failed or hung.
#
# DRY_RUN=1 prints, per lane and section, "<lane> <section> <limit>" and the command (tab-separated), runs and
# writes nothing, and exits non-zero on an unknown section (tests/test_benchmark_suite.py checks every section so):
#   DRY_RUN=1 bash benchmarks/gpu_suite.sh /tmp/out abc1234 0,1:tests,comm,optim,checkpoint
set -u
OUT=$1; COMMIT=$2; shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ODC_COMMIT=$COMMIT
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"

declare -A LIMIT=([tests]=540 [tests_rest]=360 [tests_four]=240 [tests_copy_engine]=480 [fully_shard]=300 [trl]=480 [comm]=240 [optim]=240 [park]=360 [park_backward]=570 [checkpoint]=180 [train1b]=300 [e2e_balanced]=300
                  [e2e_balanced_8b]=420 [e2e_longtail]=420 [e2e_longtail_8b]=570 [memory_8b_balanced]=540 [memory_8b_longtail]=570
                  [best_fit_1b]=560 [best_fit_8b_balanced_odc]=570 [best_fit_8b_balanced_fsdp2]=400
                  [best_fit_8b_longtail_odc]=570 [best_fit_8b_longtail_fsdp2]=400 [hf_8b_balanced]=540
                  [hf_8b_longtail]=570 [hf_1b_vs_llama_1b]=570 [hf_finetune_longtail]=570 [sim_heldout_8b]=570
                  [tests_float8]=570 [fp8_1gpu]=540 [fp8_8b_balanced]=570 [fp8_8b_balanced_lean]=400
                  [levers_8b_balanced]=560 [levers_8b_longtail]=570 [tests_eight]=400 [n8_8b_longtail]=570
                  [n8_14b_longtail]=570 [n8_8b_balanced]=480 [n8_hsdp_8b_longtail]=570)

per_test_bound() {  # pytest-timeout's option, where the plugin is installed (carry its wheel); spawn bounds either way
  if python3 -c 'import pytest_timeout' 2>/dev/null; then echo "--timeout $1"; else echo "-p no:timeout"; fi
}

section_cmd() {  # section, gpus in lane, port, dir
  local s=$1 n=$2 port=$3 dir=$4 extra
  local var="ARGS_$s"; extra=${!var:-}
  local run="torchrun --nproc-per-node=$n --master-port=$port"
  case $s in
    tests)  # (test_torch_private: the private-API adapter under the host's torch, the oldest of TESTED_TORCH)
      # on 2+ GPUs the one-GPU inductor compile tests (about 190 s) are left to a one-GPU lane, and the
      # copy-engine gather's 2-GPU tests to tests_copy_engine, to fit the limit with room for one bounded hang
      local select=""; [ "$n" -gt 1 ] && select="-k 'not inductor and not copy_engine'"
      echo "ODC_RESULTS=$dir/gpu_measured.jsonl ODC_TEST_OUTCOMES=$dir/outcomes.jsonl python3 -m pytest" \
           "tests/test_kernels.py tests/test_loss.py tests/test_gpu.py" \
           "-q -p no:cacheprovider" \
           "$(per_test_bound 300)" \
           "--junitxml=$dir/gpu_tests.xml $select" \
           "$extra" ;;
    tests_rest)  # the GPU tests that no longer fit `tests`' limit (at f0ddbfb its 2-GPU lane ran 509 s of tests,
      # test_gpu.py 473 of them, before these files began): the standard loop's, the parked state's, split_masters',
      # the private-API adapter's, the explicit minibatch's
      local select=""; [ "$n" -gt 1 ] && select="-k 'not inductor'"  # as in tests: a one-GPU lane's
      echo "ODC_RESULTS=$dir/gpu_measured.jsonl ODC_TEST_OUTCOMES=$dir/outcomes.jsonl python3 -m pytest" \
           "tests/test_standard_loop.py tests/test_gpu_parking.py tests/test_gpu_split_masters.py" \
           "tests/test_torch_private.py tests/test_explicit_minibatch.py -q -p no:cacheprovider $(per_test_bound 240)" \
           "--junitxml=$dir/gpu_tests.xml $select $extra" ;;
    tests_four)  # the 4-GPU parity tests (nvshmem with uneven counts, collective), about 20 s each
      echo "ODC_RESULTS=$dir/gpu_measured.jsonl ODC_TEST_OUTCOMES=$dir/outcomes.jsonl python3 -m pytest" \
           "tests/test_gpu.py -k four_gpus -q -p no:cacheprovider $(per_test_bound 120)" \
           "--junitxml=$dir/gpu_tests.xml $extra" ;;
    tests_eight)  # issue 45: HSDP parity on 8 GPUs, 2 replicas of 4 shards and 4 of 2 (tests/test_gpu.py)
      echo "ODC_RESULTS=$dir/gpu_measured.jsonl ODC_TEST_OUTCOMES=$dir/outcomes.jsonl python3 -m pytest" \
           "tests/test_gpu.py -k eight_gpus -q -p no:cacheprovider $(per_test_bound 180)" \
           "--junitxml=$dir/gpu_tests.xml $extra" ;;
    n8_8b_longtail|n8_14b_longtail)  # issue 45 item 2, 8 GPUs: 4 long-tailed samples (8K-64K) per GPU, seed 0
      # (ARGS_<section>="--seed 1" for the other), odc + LB-Mini against FSDP2 + LB-Micro and (8B) fsdp2_nosync,
      # FSDP2 first, each in its own processes (14B's steps are twice 8B's: fsdp2_nosync left out to fit a call);
      # predicted in results/sim/predict_n8_<size>_longtail before the run
      local size=${s#n8_} methods="fsdp2 fsdp2_nosync odc"; size=${size%_longtail}
      [ "$size" = 14b ] && methods="fsdp2 odc"
      echo "python3 -m benchmarks.e2e_bench --isolate --size $size --workloads longtail --batch $((4 * n))" \
           "--steps 3 --warmup 1 --activation-checkpointing --compile --methods $methods" \
           "--balancers lb_mini --keep-going --out $dir --commit $COMMIT $extra" ;;
    n8_8b_balanced)  # issue 45 item 3, 8 GPUs: 2 x 4K per GPU, odc against FSDP2 (predicted in
      # results/sim/predict_n8_8b_balanced)
      echo "python3 -m benchmarks.e2e_bench --isolate --size 8b --workloads balanced --batch $((2 * n)) --steps 4" \
           "--warmup 2 --activation-checkpointing --compile --methods fsdp2 fsdp2_nosync odc --keep-going" \
           "--out $dir --commit $COMMIT $extra" ;;
    n8_hsdp_8b_longtail)  # issue 45 item 4, 8 GPUs: HSDP 2 x 4 (--replicas 2), odc + LB-Mini against FSDP2's HSDP
      echo "python3 -m benchmarks.e2e_bench --isolate --size 8b --workloads longtail --batch $((4 * n)) --replicas 2" \
           "--steps 3 --warmup 1 --activation-checkpointing --compile --methods fsdp2 odc --balancers lb_mini" \
           "--keep-going --out $dir --commit $COMMIT $extra" ;;
    tests_copy_engine)  # 4 cases on 2 GPUs, each bounded at 90 s by spawn: at most ~7 min if every one hangs
      echo "ODC_RESULTS=$dir/gpu_measured.jsonl ODC_TEST_OUTCOMES=$dir/outcomes.jsonl python3 -m pytest" \
           "tests/test_gpu.py -k copy_engine -q -p no:cacheprovider $(per_test_bound 150)" \
           "--junitxml=$dir/gpu_tests.xml $extra" ;;
    fully_shard)  # issue 34: the torchtitan-style script through torch's fully_shard and odcfsdp's, and uneven counts
      echo "ODC_RESULTS=$dir/gpu_measured.jsonl ODC_TEST_OUTCOMES=$dir/outcomes.jsonl python3 -m pytest" \
           "tests/test_gpu_fully_shard.py -q -p no:cacheprovider $(per_test_bound 240)" \
           "--junitxml=$dir/gpu_tests.xml $extra" ;;
    trl)  # issue 42 item 6: SFTTrainer on accelerate's FSDP2 plugin, torch's fully_shard and ours (after
      # odcfsdp.patch_fsdp2), two cases of two torchrun launches each, every launch bounded at 180 s by the test
      echo "ODC_RESULTS=$dir/gpu_measured.jsonl ODC_TEST_OUTCOMES=$dir/outcomes.jsonl python3 -m pytest" \
           "tests/test_gpu_trl.py -q -p no:cacheprovider $(per_test_bound 420)" \
           "--junitxml=$dir/gpu_tests.xml $extra" ;;
    comm) echo "$run -m benchmarks.comm_bench --iters 20 --out $dir --commit $COMMIT $extra" ;;
    optim) echo "python3 -m benchmarks.optim_bench --sizes 1b 8b --world 2 --out $dir --commit $COMMIT $extra" ;;
    park)  # issue 41 item 4: the parked optimizer state's copies at 8B's rank-0 shards of 2 ranks, one GPU
      echo "python3 -m benchmarks.park_bench --size 8b --world 2 --fractions 0.8 1.0 --out $dir --commit $COMMIT" \
           "$extra" ;;
    park_backward)  # issue 41 item 4, one GPU: odc with all of AdamW's state parked, brought back under the last
      # backward ([park-backward]) with the largest micro-batch last or in the plan's order (park_largest_first),
      # its copies out queued a chunk at a time ([park-trickle], the default) or all at once (park_at_once), with the
      # share that fits 40% of the GPU (parkfit40), against odc unparked; 3B long-tailed, 4 samples of 8K-64K, each
      # method in its own process;
      # one profiled step each: where the host waits for the copies
      echo "python3 -m benchmarks.e2e_bench --isolate --size 3b --workloads longtail --batch $((4 * n)) --steps 3" \
           "--warmup 1 --balancers lb_mini --activation-checkpointing --compile --methods odc" \
           "--variants park park+park_largest_first park+park_at_once parkfit40 --memory-breakdown" \
           "--profile odc-park odc-park+park_largest_first --keep-going" \
           "--out $dir --commit $COMMIT $extra" ;;
    checkpoint) echo "$run -m benchmarks.checkpoint_bench --size 1b --dir /tmp/odcfsdp_ckpt_$port --out $dir --commit $COMMIT $extra" ;;
    train1b) echo "$run -m odcfsdp.train +experiment=llama1b_longtail run.out_dir=$dir $extra" ;;
    e2e_balanced)  # weak scaling: 8 samples of 4096 tokens per GPU per minibatch
      echo "$run -m benchmarks.e2e_bench --size 1b --workloads balanced --batch $((8 * n)) --steps 6 --warmup 2" \
           "--ablate prefetch0 no_overlap unfused --profile odc fsdp2 --keep-going --out $dir --commit $COMMIT $extra" ;;
    e2e_balanced_8b)  # 2 samples of 4096 tokens per GPU, recomputation: what fits an 8B model next to FSDP2's
      echo "$run -m benchmarks.e2e_bench --size 8b --workloads balanced --batch $((2 * n)) --steps 4 --warmup 2" \
           "--activation-checkpointing --methods odc fsdp2 --profile odc fsdp2 --keep-going --out $dir" \
           "--commit $COMMIT $extra" ;;
    e2e_longtail)  # 4 samples of 8K-64K tokens per GPU per minibatch
      echo "$run -m benchmarks.e2e_bench --size 1b --workloads longtail --batch $((4 * n)) --steps 4 --warmup 1" \
           "--activation-checkpointing --ablate no_overlap --profile odc fsdp2 --keep-going --out $dir --commit $COMMIT $extra" ;;
    e2e_longtail_8b)  # issue 26's 8B validation points: 4 long-tailed samples (8K-64K) per GPU (--batch 2n: 2)
      echo "$run -m benchmarks.e2e_bench --size 8b --workloads longtail --batch $((4 * n)) --steps 3 --warmup 1" \
           "--activation-checkpointing --compile --methods odc fsdp2 --keep-going --out $dir --commit $COMMIT $extra" ;;
    memory_8b_balanced)  # issues 23, 31: speed and memory by category at the peak, FSDP2 (torchtitan's way, and
      # fsdp2_nosync: sync and reshard off until the last micro-batch) first, then odc (default, gather_masters, lean)
      echo "$run -m benchmarks.e2e_bench --size 8b --workloads balanced --batch $((2 * n)) --steps 3 --warmup 1" \
           "--activation-checkpointing --compile --methods fsdp2 fsdp2_nosync odc --variants gather_masters lean" \
           "--memory-breakdown --keep-going --out $dir --commit $COMMIT $extra" ;;
    memory_8b_longtail)  # the same on 4 long-tailed samples (8K-64K) per GPU; lb_mini and lb_micro for odc
      echo "$run -m benchmarks.e2e_bench --size 8b --workloads longtail --batch $((4 * n)) --steps 2 --warmup 1" \
           "--activation-checkpointing --compile --methods fsdp2 fsdp2_nosync odc --variants lean --memory-breakdown" \
           "--keep-going --out $dir --commit $COMMIT $extra" ;;
    best_fit_1b)  # 8 samples of 4K per GPU; DDP too at 1B
      echo "python3 -m benchmarks.best_fit --nproc $n --port $port --size 1b --workloads balanced --methods odc fsdp2" \
           "ddp --micro-samples 4 2 --batch $((8 * n)) --steps 3 --warmup 1 --timeout-s 120 --out $dir --commit $COMMIT" \
           "$extra" ;;
    best_fit_8b_balanced_odc|best_fit_8b_balanced_fsdp2)  # 2 samples of 4K per GPU
      echo "python3 -m benchmarks.best_fit --nproc $n --port $port --size 8b --workloads balanced --methods ${s##*_}" \
           "--micro-samples 2 1 --batch $((2 * n)) --steps 2 --warmup 1 --timeout-s 150 --out $dir --commit $COMMIT" \
           "$extra" ;;
    best_fit_8b_longtail_odc|best_fit_8b_longtail_fsdp2)  # 4 long-tailed samples (8K-64K) per GPU
      echo "python3 -m benchmarks.best_fit --nproc $n --port $port --size 8b --workloads longtail --methods ${s##*_}" \
           "--batch $((4 * n)) --steps 2 --warmup 1 --timeout-s 180 --out $dir --commit $COMMIT $extra" ;;
    hf_8b_balanced)  # issue 24: 2 samples of 4096 tokens per GPU, compiled layers + recomputation for both
      echo "$run -m benchmarks.e2e_bench --model hf:llama3-8b --workloads balanced --batch $((2 * n)) --steps 4" \
           "--warmup 2 --activation-checkpointing --compile --methods hf_fsdp2 hf_fsdp2_nosync odc --profile odc hf_fsdp2" \
           "--keep-going --out $dir --commit $COMMIT $extra" ;;
    hf_8b_longtail)  # 4 long-tailed samples (8K-64K) per GPU: odc lb_mini (and lb_micro) vs hf_fsdp2 lb_micro;
      # expandable segments for every method, as the CLI's long-tailed runs are advised to (reserved near allocated)
      echo "$run -m benchmarks.e2e_bench --model hf:llama3-8b --workloads longtail --batch $((4 * n)) --steps 3" \
           "--warmup 1 --activation-checkpointing --compile --methods hf_fsdp2 hf_fsdp2_nosync odc --keep-going" \
           "--out $dir" \
           "--alloc-conf expandable_segments:True --commit $COMMIT $extra" ;;
    sim_heldout_8b)  # issue 31: held out from the simulator's 8B fit (n2_8b_longtail_memory_949626a: seed 0, 4 per
      # GPU): seed 1 and 2 long-tailed samples per GPU, another data stream; then python -m benchmarks.step_sim --validate --size 8b
      # --held-out <this run's results/e2e folder>. About 3 runs x 5 steps of ~8 s + compile and builds, in 570 s
      echo "$run -m benchmarks.e2e_bench --size 8b --workloads longtail --batch $((2 * n)) --seed 1 --steps 4" \
           "--warmup 1 --activation-checkpointing --compile --methods fsdp2 odc --keep-going --out $dir" \
           "--commit $COMMIT $extra" ;;
    hf_1b_vs_llama_1b)  # the same long-tailed samples (128256-token vocabulary) through our 1B and the HF 1B shape
      local e2e="-m benchmarks.e2e_bench --workloads longtail --batch $((4 * n)) --steps 3 --warmup 1" \
            flags="--activation-checkpointing --compile --keep-going --alloc-conf expandable_segments:True --commit $COMMIT $extra"
      echo "$run $e2e --size 1b --vocab 128256 --methods odc fsdp2 --out $dir/llama $flags;" \
           "$run $e2e --model hf:llama-1b --methods odc hf_fsdp2 hf_ddp --out $dir/hf $flags;" \
           "python3 -m benchmarks.e2e_summary $dir/llama/e2e_bench.json $dir/hf/e2e_bench.json --out $dir/summary.md" ;;
    hf_finetune_longtail)  # the e2e bench's odc on the HF 1B shape, then the CLI on long-tailed chats of that model
      echo "$run -m benchmarks.e2e_bench --model hf:llama-1b --workloads longtail --batch $((4 * n)) --steps 3" \
           "--warmup 1 --activation-checkpointing --compile --methods odc --alloc-conf expandable_segments:True" \
           "--out $dir/e2e --commit $COMMIT;" \
           "python3 -m benchmarks.hf_finetune_check --size llama-1b --chats longtail --gpus $n --steps 8" \
           "--e2e $dir/e2e/e2e_bench.json --out $dir --commit $COMMIT $extra" ;;
    tests_float8)  # one GPU is enough: the 200-step numerics and the CPU-side float8 tests, with torchao
      echo "ODC_RESULTS=$dir/gpu_measured.jsonl ODC_TEST_OUTCOMES=$dir/outcomes.jsonl python3 -m pytest" \
           "tests/test_float8_gpu.py tests/test_float8.py tests/test_float8_gather.py tests/test_float8_gather_edges.py" \
           "-q -p no:cacheprovider" \
           "$(per_test_bound 360)" \
           "--junitxml=$dir/gpu_tests.xml $extra" ;;
    fp8_1gpu)  # 4 layers of dim 4096 / ffn 14336, 2 x 4096 tokens per step, compiled; one GPU whatever the lane has
      echo "python3 -m benchmarks.fp8_bench --layers 4 --steps 12 --warmup 4 --out $dir --commit $COMMIT $extra" ;;
    fp8_8b_balanced|fp8_8b_balanced_lean)  # e2e_balanced_8b's workload, both methods with torchao float8 gathered
      # in float8 (odc: float8_gather, [float8-gather]; FSDP2: float8 all-gather and the scales precomputed after each
      # step, torchtitan's settings), each method in a process group of its own (--isolate: FSDP2's float8 run failed
      # after odc's in one process); bf16 figures: e2e_balanced_8b in the same call. _lean: odc with its masters
      # gathered for the bf16 groups (gather_masters: no bf16 rows; the float8 groups keep their float8 rows)
      # unbounded_pushes: odc with its gradient buffers freed by record_stream, as before one push in flight became
      # the default ([streams] 2): what the bound buys
      local methods="fsdp2 odc --variants unbounded_pushes"; [ "$s" = fp8_8b_balanced_lean ] && methods="odc-gather_masters"
      echo "python3 -m benchmarks.e2e_bench --isolate --size 8b --workloads balanced --batch $((2 * n)) --steps 4" \
           "--warmup 2 --activation-checkpointing --compile --float8 tensorwise --float8-gather --methods $methods" \
           "--memory-breakdown --keep-going --out $dir --commit $COMMIT $extra" ;;
    levers_8b_balanced|levers_8b_longtail)  # issue 41: odc's memory levers, each on top of the default, against
      # FSDP2 and FSDP2 with sync off until the last micro-batch (first, so no order favours odc), every method in
      # processes of its own, peak by category, one profiled step of FSDP2 and odc (the host's time per hook site,
      # issue 41 item 3) (LEVERS: the odc variants; park: its optimizer state on the host
      # between steps, [parking]; parkfit51, longtail's default: the share that fits 51% of an H200, an 80 GB H100's
      # 90%, [park-fit]; a fifth method, e.g. parkfit51+park_at_once, does not fit the limit at 2 GPUs; balanced's
      # default: split_masters, the masters as rows + low bits inside a minibatch, [split-masters], and
      # gather_masters, the masters gathered, [gather-masters]: the two ways to drop the bf16 rows); balanced:
      # 2 x 4K per GPU; longtail: 4 samples of 8K-64K per GPU, odc with LB-Mini only (FSDP2 with LB-Micro)
      local w=balanced b=$((2 * n)) st="--steps 4 --warmup 2" v="split_masters gather_masters"
      v=${LEVERS:-$v}  # LEVERS: other variants (e.g. "unit_groups gather_masters+unit_groups")
      [ "$s" = levers_8b_longtail ] && w=longtail b=$((4 * n)) st="--steps 3 --warmup 1 --balancers lb_mini" \
        v=${LEVERS:-parkfit51}
      echo "python3 -m benchmarks.e2e_bench --isolate --size 8b --workloads $w --batch $b $st" \
           "--activation-checkpointing --compile --methods fsdp2 fsdp2_nosync odc --variants $v --memory-breakdown" \
           "--profile fsdp2 odc --keep-going" \
           "--out $dir --commit $COMMIT $extra" ;;
    *) return 1 ;;
  esac
}

pack() {  # lane index: its folder into OUT/lane<k>.tar.gz, replaced atomically
  tar -czf "$OUT/.lane$1.tmp" -C "$OUT" --exclude=checkpoints "lane$1" 2>/dev/null && mv "$OUT/.lane$1.tmp" "$OUT/lane$1.tar.gz"
}

lane() {  # index, gpus, sections (comma-separated); DRY_RUN=1: print each command instead; 1 if a section is unknown
  local k=$1 gpus=$2 sections=$3 n port s dir cmd limit var rc=0
  n=$(awk -F, '{print NF}' <<<"$gpus")
  port=$((29500 + 17 * k))
  for s in ${sections//,/ }; do
    dir=$OUT/lane$k/${s}_n$n
    if ! cmd=$(section_cmd "$s" "$n" "$port" "$dir"); then echo "lane $k: unknown section $s" >&2; rc=1; continue; fi
    var="SECTION_TIMEOUT_$s"; limit=${!var:-${LIMIT[$s]:-none}}
    if [[ ${DRY_RUN:-0} == 1 ]]; then printf '%s %s %s\t%s\n' "$k" "$s" "$limit" "$cmd"; continue; fi
    mkdir -p "$dir"
    echo "=== lane $k (GPUs $gpus) $s: start $(date +%T), limit ${limit}s"
    echo "$cmd" > "$dir/command.txt"
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "$limit" bash -c "$cmd" > "$dir/$s.log" 2>&1 &
    pid=$!
    t=0  # pack every 30 s while it runs: partial results survive a call cut off by its time limit
    while kill -0 $pid 2>/dev/null; do sleep 2; t=$((t + 2)); ((t % 30)) || pack "$k"; done
    wait $pid
    echo "=== lane $k $s: exit $? at $(date +%T); $(tail -2 "$dir/$s.log" | tr '\n' ' ' | cut -c1-300)"
    rm -rf "$dir/checkpoints"
    pack "$k"
  done
  return $rc
}

if [[ ${DRY_RUN:-0} == 1 ]]; then  # the lanes one after another, in order; nothing written
  k=0 rc=0
  for spec in "$@"; do
    lane "$k" "${spec%%:*}" "${spec#*:}" || rc=1
    k=$((k + 1))
  done
  exit $rc
fi

mkdir -p "$OUT"
{ date -u +%FT%TZ; nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } \
  > "$OUT/host.txt" 2>&1

k=0
for spec in "$@"; do
  lane "$k" "${spec%%:*}" "${spec#*:}" &
  k=$((k + 1))
done
wait
rm -rf "$OUT"/lane*/
