#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md ("GPU"), in one go, on a CUDA machine with torch/triton/transformers installed
# and this checkout on PYTHONPATH. Each step is bounded by `timeout` so that one slow step leaves the others' output.
#   bash benchmarks/gpu_figures.sh [OUTDIR] [STAGE]      # STAGE: short (default: all), pipeline, lazy (the re-fit
#   objective's Triton engine against the torch reference), refit (the re-fit objective's engines at 2 to 1536 rows
#   per batch), tiles (the Triton pair scan's tile shapes), default (2 blocks of 8B with the default: ALPS's
#   solution, 3 tuning epochs), swaps (2 blocks of 8B with SparseSwaps' spec, the default until 2026-11-27; the
#   stage was called default then), or swaps-full (all 32 blocks); several stages comma-separated
#   (e.g. tiles,refit) run one after the other in one call (one machine start)
set -u -o pipefail
out=${1:-gpu_out}; stages=${2:-short}; mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
step() { local secs=$1; shift; echo "### $(date -u +%T) $*"; timeout "$secs" "$@"; echo "### rc=$?"; }
for stage in ${stages//,/ }; do
if [ "$stage" = short ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  step 120 python3 -m pytest -q -p no:cacheprovider tests/core/backends/test_triton.py
  step 120 python3 benchmarks/swap_search.py --device cuda --widths 576 1536 4096 14336 --rows 64
  step 150 python3 benchmarks/refit_swaps.py --device cuda --widths 576 1536 4096 14336
  # larger row batches: the torch engine's launches are shared by more rows (not measured yet)
  step 150 python3 benchmarks/refit_swaps.py --device cuda --widths 576 1536 4096 --rows 64
fi
# the Triton re-fit engine (refit_lazy_triton: the lazy state's pending rank-one terms, its scan, moves and scan
# terms in Triton kernels; what backend="auto" and "triton" give on CUDA) against the torch reference, and where its
# iteration's time goes: ~3 min on an H200 (BENCHMARKS.md "GPU")
if [ "$stage" = lazy ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
  step 120 python3 -m pytest -q -p no:cacheprovider tests/core/backends/test_refit_lazy_triton.py
  step 100 python3 benchmarks/refit_swaps.py --device cuda --widths 576 1536 4096 --rows 256 --engines torch triton
  step 180 python3 benchmarks/refit_swaps.py --device cuda --widths 14336 --rows 32 --engines torch triton
  step 60 python3 benchmarks/refit_iteration_profile.py --engine triton --width 4096 --rows 256
  step 100 python3 benchmarks/refit_swaps.py --device cuda --widths 576 1536 --rows 1536 --engines torch triton
  step 60 python3 benchmarks/refit_iteration_profile.py --engine triton --width 576 --rows 1536
  # what one iteration asks of the device (counted on the CPU too; on CUDA the transfers count as _to_copy)
  for engine in triton mask; do
    step 60 python3 benchmarks/refit_iteration_profile.py --engine $engine --count --width 576 --rows 1536
  done
  step 100 python3 benchmarks/refit_swaps.py --device cuda --widths 576 1536 4096 --rows 16 --pattern 2:4 \
    --engines torch triton
fi
# the re-fit objective's engines (torch, triton) at 2 to 1536 rows per batch, profiles: ~5 min on an H200, then 2:4
if [ "$stage" = refit ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
  step 90 python3 -m pytest -q -p no:cacheprovider tests/core/backends/test_refit_lazy_triton.py tests/core/backends/test_triton.py
  # where an iteration's GPU time goes (the update's passes over H and Z, the scan, the torch terms), at 8B's width
  # and at the default model's (a whole layer per batch: bound by the per-call costs, BENCHMARKS.md "Half of H")
  step 60 python3 benchmarks/refit_iteration_profile.py --width 4096 --rows 256
  step 60 python3 benchmarks/refit_iteration_profile.py --width 576 --rows 1536
  step 60 python3 benchmarks/refit_swaps.py --device cuda --widths 576 1536 --rows 1536
  # the default row batch (REFIT_CUDA_FRACTION: 11 rows at 14336 and ~146 at 4096 on an H200) against larger ones:
  # time per row and peak memory, to choose the fraction
  step 150 python3 benchmarks/refit_row_batch.py --device cuda --width 14336 --rows 64 --row-batches 32
  step 120 python3 benchmarks/refit_row_batch.py --device cuda --width 4096 --rows 512 --row-batches 256
  # where the build's time goes at down_proj's width (5.2x a least-squares re-fit there, 0.66x at 4096)
  step 120 python3 benchmarks/refit_iteration_profile.py --build --width 14336 --rows 32
  for rows in 2 16 256; do
    step 100 python3 benchmarks/refit_swaps.py --device cuda --widths 576 1536 4096 --rows $rows
  done
  step 200 python3 benchmarks/refit_swaps.py --device cuda --widths 14336 --rows 32
  # 2:4: the scan evaluates only the kept slots of each tile's blocks (refit_lazy_triton.kept_slot_ranges)
  step 100 python3 benchmarks/refit_swaps.py --device cuda --widths 576 1536 4096 --rows 16 --pattern 2:4
fi
# the Triton pair scan's tile shapes and programs per SM: ~1-2 min on an H200, then 2:4
if [ "$stage" = tiles ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  # the scan alone is bound by its fixed cost since the bound skip (BENCHMARKS.md): three tiles suffice
  step 150 python3 benchmarks/refit_scan_tiles.py --tiles 16x32x4 4x128x4 32x64x8 --per-sm 4 16
  step 100 python3 benchmarks/refit_scan_tiles.py --pattern 2:4 --tiles 4x256x4 4x64x4 16x32x4 --per-sm 4
fi
if [ "$stage" = short ] || [ "$stage" = pipeline ]; then
  step 300 python3 benchmarks/llm_pipeline.py --model llama-3.1-8b --blocks 2 --iters 0 1 5 25 100 --device cuda \
    --json "$out/llm_pipeline_8b_2blocks.json"
  step 240 python3 benchmarks/llm_pipeline.py --model llama-3.1-8b --blocks 2 --iters 25 --block-tune-epochs 5 \
    --device cuda --json "$out/llm_pipeline_8b_2blocks_tuned.json"
elif [ "$stage" = default ]; then  # the default (ALPS's solution, 3 tuning epochs) on 2 of 32 blocks: 2 min on an H200
  step 480 python3 benchmarks/llm_pipeline.py --model llama-3.1-8b --blocks 2 --recipe default --block-tune-epochs 3 \
    --device cuda --json "$out/llm_pipeline_8b_default_alps.json"
elif [ "$stage" = swaps ]; then  # SparseSwaps' spec (T=10, 10 tuning epochs) on 2 of 32 blocks: about 2 min on an H200
  step 330 python3 benchmarks/llm_pipeline.py --model llama-3.1-8b --blocks 2 --iters 10 --block-tune-epochs 10 \
    --device cuda --json "$out/llm_pipeline_8b_default.json"
elif [ "$stage" = swaps-full ]; then  # SparseSwaps' spec (T=10, 10 tuning epochs): about 28 min on one H100 (extrapolated)
  step 3600 python3 benchmarks/llm_pipeline.py --model llama-3.1-8b --iters 10 --block-tune-epochs 10 --device cuda \
    --json "$out/llm_pipeline_8b_full.json"
fi
done
