#!/usr/bin/env bash
# The checks a machine with a CUDA GPU runs (docs/benchmarks.md, "On a GPU"), on an image that has
# PyTorch and transformers but not tokenfuse's other needs, and no network:
#   WHEELS  a folder of wheels to install first (pydantic and its needs, gguf), or empty
#   TOKCACHE  a .tar.xz of a tokenfuse cache holding models/<name>/{config.json,tokenizer files} of the
#             bundled models (no weights: the members are their architectures with random weights)
#   OUT     where the figures go (gpu.txt, tests.txt, cuda.txt, cuda.json, bench.txt, bench.json);
#           cuda.json is scripts/bench/bench_cuda.py's --json, the shape of docs/benchmarks/gpu-<card>.json
#   TESTS_ONLY=1  skip the two benchmarks
#   CUDA_ONLY=1   only scripts/bench/bench_cuda.py (no tokenfuse bench, no tests)
# Each step has its own timeout (240 + 230 + 150 s at most) and one device command may run 600 s: with
# less time than the three take, run CUDA_ONLY=1 and TESTS_ONLY=1 as two commands (no tokenfuse bench then).
# Usage: WHEELS=.whl TOKCACHE=.gpu/cache.tar.xz OUT=/tmp/out bash scripts/bench/gpu_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:?set OUT}
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TOKENFUSE_CACHE=/tmp/tfcache
mkdir -p "$TOKENFUSE_CACHE" && tar xJf "${TOKCACHE:?set TOKCACHE}" -C "$TOKENFUSE_CACHE" --strip-components=1 || exit 1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; } 2>&1 | tee "$OUT/gpu.txt"
M=/tmp/members
if [ -z "${TESTS_ONLY:-}" ]; then
# Weight-independent figures (chunk cost, ms/token alone and GaC, memory, batched streams of 1, 8 and 32
# prompts); builds the random-weight members in $M.
timeout 240 python3 scripts/bench/bench_cuda.py --out $M --streams 1,8,32 --prompts 4 --max-new-tokens 24 \
  --json "$OUT/cuda.json" 2>&1 | grep -v -i warn | tee "$OUT/cuda.txt"
rc=$?
[ -n "${CUDA_ONLY:-}" ] && exit $rc
# The bench's rows on the members' architectures (one round over its prompt set).
timeout 230 python3 -m tokenfuse.cli bench --backends transformers \
  --models $M/smollm2-135m-instruct,$M/gemma3-270m,$M/qwen2.5-coder-0.5b-instruct \
  --methods gac,contrast --speculative-k 4 --thresholds 0.5 --repeats 1 --max-new-tokens 24 \
  --json "$OUT/bench.json" 2>&1 | grep -v -i warn | tee "$OUT/bench.txt"
fi
# The engine's exact-output tests with the tiny members' forwards on the GPU.
TOKENFUSE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -m "not real" -p no:cacheprovider -n 12 --dist load \
  -k "not lm_eval" --durations=5 tests/test_engine.py tests/test_speculative.py tests/test_exact_calls.py \
  tests/test_unite.py tests/test_contrast.py tests/test_safe.py tests/test_logprobs.py tests/test_trace.py \
  tests/test_sync.py tests/test_adaptive.py tests/test_likelihood.py > "$OUT/tests.txt" 2>&1
tail -25 "$OUT/tests.txt"
