#!/usr/bin/env bash
# The GPU benchmarks, on one CUDA GPU. Run from the repository root on the GPU machine:
#
#   bash bench/device_run.sh [compare] [extra compare.py options]
#       bench/compare.py at Flux-dev's shape (19 double + 38 single blocks, hidden 3072, 11.9 B
#       parameters, bf16, 4096 image + 512 text tokens): ours against ComfyUI's fused and bypass
#       paths, in under 8 minutes on an H200.
#   bash bench/device_run.sh engine
#       the engine alone, no ComfyUI needed, in about 3 to 4 minutes: bench/engine_bench.py on 4
#       Flux-shaped blocks at 4096 tokens (step overhead against bare GEMMs, strength change, warm
#       activation, LoHa and LoKr products against their ΔW on the dense path, per-item strengths on a
#       batch of 16), then bench/compile_bench.py (inductor graphs counted across adapter changes,
#       compiled step against compiled base).
#
# It needs, inside the repository (both folders are git-ignored; bench/README.md has the commands
# that make them on a machine with the ComfyUI checkout):
#   .comfy/   ComfyUI's comfy/, folder_paths.py, node_helpers.py, comfyui_version.py (about 18 MB)
#   .whl/     wheels of comfy-aimdo (ComfyUI imports it unconditionally) and comfy-kitchen (its quantized
#             tensors, used where installed), for that machine's python
# With the device tool: run(command="bash bench/device_run.sh", carry=[".comfy", ".whl"], timeout_s=540).
# The table is printed and also written to $OUT/compare_full.txt (else ./compare_full.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
MODE=compare
case "${1:-}" in
    compare|engine) MODE=$1; shift ;;
esac

if [ "$MODE" = engine ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    DIR=${OUT:-.}
    timeout 210 "$PY" bench/engine_bench.py --device cuda --dtype bf16 --blocks 4 --tokens 4096 \
        --grid 16 --grid-tokens 1024 "$@" 2>&1 | tee "$DIR/engine_cuda.txt"
    rc=${PIPESTATUS[0]}
    timeout 180 "$PY" bench/compile_bench.py --device cuda --dtype bf16 --tokens 4096 2>&1 \
        | tee "$DIR/compile_cuda.txt"
    rc2=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && exit "$rc"
    exit "$rc2"
fi

if [ ! -f .comfy/comfy/sd.py ]; then
    echo "missing .comfy/ (ComfyUI's comfy/ and top-level modules); see bench/README.md" >&2
    exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

LOG=${OUT:-.}/compare_full.txt
# Fused first application of 1 to 8 rank-32 LoRAs takes about 20 s at this size, and every change of
# weight patches moves the model through host memory: one first application per k, 3 strength changes.
timeout 460 "$PY" bench/compare.py --comfy .comfy --device cuda --dtype bf16 --full \
    --repeat 3 --repeat-apply 1 --repeat-apply-fused 1 "$@" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
