#!/usr/bin/env bash
# The GPU runs, by section, each packed into one archive under OUT (the device tool returns few files).
#
#   bash benchmarks/gpu_suite.sh OUT COMMIT SECTION...
#
# Sections: tests, comm, checkpoint, train1b, e2e_balanced, e2e_longtail.
# Run from the repository root on a host with 2 GPUs, python3 with torch/triton, and nvshmem4py and
# hydra on PYTHONPATH. Every section goes on after a failure of another, and logs to OUT/<section>.log.
set -u
OUT=$1; COMMIT=$2; shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ODC_COMMIT=$COMMIT
run2() { torchrun --nproc-per-node=2 "$@"; }
for section in "$@"; do
  dir=$OUT/$section
  mkdir -p "$dir"
  echo "=== $section ($(date +%T))"
  case $section in
    tests)
      ODC_RESULTS=$dir/gpu_measured.jsonl python3 -m pytest tests/test_kernels.py tests/test_fused_adamw.py \
        tests/test_gpu.py -q -p no:cacheprovider --junitxml="$dir/gpu_tests.xml" ;;
    comm)
      run2 benchmarks/comm_bench.py --iters 20 --out "$dir" --commit "$COMMIT" ;;
    checkpoint)
      run2 benchmarks/checkpoint_bench.py --size 1b --dir /tmp/odcfsdp_ckpt --out "$dir" --commit "$COMMIT" ;;
    train1b)
      run2 -m odcfsdp.train +experiment=llama1b_longtail run.out_dir="$dir" \
        && python3 -m odcfsdp.plot "$dir" --warmup 2 ;;
    e2e_balanced)
      run2 benchmarks/e2e_bench.py --size 1b --workloads balanced --steps 5 --warmup 2 \
        --ablate prefetch0 no_overlap unfused --out "$dir" --commit "$COMMIT" ;;
    e2e_longtail)
      run2 benchmarks/e2e_bench.py --size 1b --workloads longtail --steps 4 --warmup 1 --activation-checkpointing \
        --ablate no_overlap --out "$dir" --commit "$COMMIT" ;;
    *) echo "unknown section $section"; continue ;;
  esac > "$dir/$section.log" 2>&1
  echo "exit $? ; $(tail -3 "$dir/$section.log" | tr '\n' ' ')"
  rm -rf "$dir/checkpoints"
  tar -czf "$OUT/$section.tar.gz" -C "$OUT" "$section" && rm -rf "$dir"
done
