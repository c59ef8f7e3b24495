#!/usr/bin/env bash
# One prepared run on a lent CUDA machine: the CUDA tests, then the GPU figures (docs/benchmarks/gpu.md).
#
# Run from the repository root on the GPU machine, after building the wheel here
# (`.venv/bin/python -m pip wheel --no-deps --no-build-isolation -w .whl .`, .whl/ ignored by git):
#     bash benchmarks/gpu_check.sh [tests] [fused] [benchmarks] [gp] [subset] [eigenpro4]
#     (default: fused tests benchmarks)
# (logs under $OUT).
# Each step has its own time limit, so one failure leaves the others' figures. "gp" runs
# bench_gp_default.py on the card (the default GP and GPyTorch's SGPR / SVGP); it reads the shared data
# from $KGP_SHARED_DATA (default ./.gpudata: copy ../shared/data/uci/*.csv.gz and the airline .npz there).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -m pip install -q --no-deps --no-index .whl/kgp-*.whl 2>&1 | tail -3 \
    || $PY -m pip install -q --no-deps --no-index --no-build-isolation -e . 2>&1 | tail -3
$PY -c "import torch, gpytorch, kgp; print('torch', torch.__version__, 'gpytorch', gpytorch.__version__,
'kgp', kgp.__version__, torch.cuda.get_device_name(), [p.name for p in kgp.list_plugins()])" | tee -a "$OUT/gpu.txt"

STEPS=" ${*:-fused tests benchmarks} "
if [[ $STEPS == *" fused "* ]]; then
# first, so that the slower steps cannot take its figures; d = 28 in its own call (the one shape
# whose tuned FMA-loop run once did not finish within 80 s)
# Triton prints each tuning's time and chosen tile shape (is the d = 28 time tuning, or the kernel?)
export TRITON_PRINT_AUTOTUNING=1
echo "== the fused pass against the blocked pass and the stored K (one process), d = 8"
timeout 90 $PY benchmarks/bench_fused_gpu.py --shapes 200000x2000x8,200000x10000x8,200000x20000x8 2>&1 \
    | tee "$OUT/fused.md"
echo "== the same at n = 1e6, M = 10,000, d = 28 (RBF)"
timeout 90 $PY benchmarks/bench_fused_gpu.py --shapes 1000000x10000x28 --families rbf 2>&1 | tee -a "$OUT/fused.md"
echo "== the 1e6 x 28 row at M = 10,000 (float32): blocked, then fused (the default on tensor-core cards)"
KGP_FUSED_KERNELS=never timeout 60 $PY benchmarks/bench_falkon.py --only-scale --device cuda 2>&1 | tee "$OUT/scale.md"
KGP_FUSED_KERNELS=auto timeout 90 $PY benchmarks/bench_falkon.py --only-scale --device cuda 2>&1 | tee -a "$OUT/scale.md"
echo "== tile shapes of the tensor-core kernels"
timeout 150 $PY benchmarks/bench_fused_tiles.py --shapes 200000x2000x8,200000x10000x8,200000x20000x8 2>&1 | tee "$OUT/tiles.md"
timeout 100 $PY benchmarks/bench_fused_tiles.py --shapes 200000x10000x20,1000000x10000x28 --families rbf 2>&1 | tee -a "$OUT/tiles.md"
fi

if [[ $STEPS == *" tests "* ]]; then
echo "== CUDA-marked tests and the conformance suite (device checks run on cuda)"
timeout 200 $PY -m pytest -q -p no:cacheprovider -rs -m cuda tests 2>&1 | tee "$OUT/tests.log" | tail -15
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_conformance.py 2>&1 | tee -a "$OUT/tests.log" | tail -4

fi

if [[ $STEPS == *" benchmarks "* ]]; then
echo "== kernel pass against block size (n = 1e6, M = 10,000, d = 28)"
timeout 90 $PY benchmarks/bench_block_size.py --device cuda --n 1000000 --m 10000 --d 28 \
    --mib 8,32,64,128,256,512,1024,2048 --reps 3 2>&1 | tee "$OUT/blocks.md"

echo "== the 1e6 x 28 row at M = 10,000 (float32), blocked and fused"
KGP_FUSED_KERNELS=never timeout 150 $PY benchmarks/bench_falkon.py --only-scale --device cuda 2>&1 | tee -a "$OUT/scale.md"
timeout 150 $PY benchmarks/bench_falkon.py --only-scale --device cuda 2>&1 | tee -a "$OUT/scale.md"

echo "== roofline on the card"
timeout 150 $PY benchmarks/bench_roofline.py --device cuda --n 200000 --m 2000,5000,10000,20000 \
    --jsonl "$OUT/roofline.jsonl" 2>&1 | tee "$OUT/roofline.md"
fi

if [[ $STEPS == *" gp "* ]]; then
echo "== the default GP and GPyTorch's SGPR on the card (six sets), then airline against SVGP"
export KGP_SHARED_DATA=${KGP_SHARED_DATA:-$PWD/.gpudata}
timeout 260 $PY benchmarks/bench_gp_default.py --device cuda --runs "$OUT/gp_runs.jsonl" \
    --sets pol,elevators,bike,kin40k,protein,keggdirected 2>&1 | tee "$OUT/gp.md" | grep -v '^  ('
timeout 180 $PY benchmarks/bench_gp_default.py --device cuda --runs "$OUT/gp_runs.jsonl" --sets airline \
    2>&1 | tee "$OUT/gp_airline.md" | grep -v '^  ('
fi

if [[ $STEPS == *" subset "* ]]; then
echo "== learning-subset size over seeds (the 2-core CPU host's memory budget, so the recipe picks its M)"
export KGP_SHARED_DATA=${KGP_SHARED_DATA:-$PWD/.gpudata}
KGP_MEMORY_BUDGET=5055302041 timeout 330 $PY benchmarks/bench_subset_size.py --device cuda \
    --sets elevators,pol,bike,kin40k,protein,keggdirected --sizes 3000,4000,5000 --seeds 0,1,2 \
    --jsonl "$OUT/subset_runs.jsonl" 2>&1 | tee "$OUT/subset.md" | grep -v Warning
fi

if [[ $STEPS == *" eigenpro4 "* ]]; then
echo "== eigenpro4 at many centers on 1e6 rows (docs/benchmarks/eigenpro4.md; the 2-core CPU: 218 s an epoch at M = 1e5)"
# the rows are generated once on the host's cores (PriorDraw; bench_large.py's cache, outside $OUT); 5e6 rows and
# 1e6 centers, the target, would take most of a session's device time in generation alone
LARGE=${KGP_LARGE_CACHE:-$PWD/.gpudata/large_data}
timeout 180 $PY -c "import pathlib, sys; sys.path.insert(0, 'benchmarks'); import bench_large
print(bench_large.cached_data(pathlib.Path('$LARGE'), 1000000, 8, 10000, 0, 0.1)['generate_seconds'], 's')"
timeout 200 $PY benchmarks/bench_eigenpro4_large.py --device cuda --cache "$LARGE" --n 1000000 \
    --centers 100000 --epochs 2 --falkon-centers 20000 40000 --jsonl "$OUT/eigenpro4_runs.jsonl" 2>&1 \
    | tee "$OUT/eigenpro4.md"
timeout 240 $PY benchmarks/bench_eigenpro4_large.py --device cuda --cache "$LARGE" --n 1000000 \
    --centers 500000 --epochs 1 --jsonl "$OUT/eigenpro4_runs.jsonl" 2>&1 | tee -a "$OUT/eigenpro4.md"
fi
