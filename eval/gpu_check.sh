#!/usr/bin/env bash
# The GPU checks of issues 10 and 20 in one run (under 12 minutes on an H200: every step has its own time limit):
#   1. the Triton kernel tests on CUDA        python -m pytest -q tests/test_kernels*.py
#   2. the kernel benchmark on CUDA           vtc bench-kernels --device cuda --json $OUT/bench-kernels-cuda.json
#   3. the end-to-end prefill check           eval/gpu_prefill.py (Qwen2.5-VL-7B shapes, 64 frames, sdpa and
#                                             flash_attention_2 if it imports, unpatched vs fastv / framefusion)
#   4. attention implementations              eval/gpu_attention.py: fastv / framefusion keep flash_attention_2 on
#                                             every layer (one video and a padded batch, no fallbacks, logits vs
#                                             sdpa), and flash_attention_2 vs sdpa prefill per method from step 3
#   5. the encode stage                       eval/gpu_encode.py (Qwen2.5-VL-7B shapes, 16 frames of 448 px, at 25 %:
#                                             TTFT and tower time of random / pixelprune / tome / pixelprune+tome /
#                                             uniform, and pixelprune's tau = 0 kept fraction on a static clip)
# Logs and JSON go to $OUT (default eval/gpu-out). Every step runs even when an earlier one fails; the exit code
# is the number of failed steps. `--dry-run` prints the commands and checks the environment without running them.
#
# Nothing is installed: the device image brings torch, triton, transformers, pluggy, rich, pytest and hypothesis.
# vtc runs from this checkout; vtc_kernels / vtc_plugins (the folders kernels/ and plugins/) are made importable
# through links in a temporary folder on PYTHONPATH.
set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/eval/gpu-out}
PY=${PYTHON:-python3}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

mkdir -p "$OUT"
SITE=$(mktemp -d)
ln -s "$ROOT/kernels" "$SITE/vtc_kernels"
ln -s "$ROOT/plugins" "$SITE/vtc_plugins"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error VTC_DISABLE_PLUGIN_AUTOLOAD=1

failed=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    if [ $DRY = 1 ]; then
        return 0
    fi
    local start=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" = 0 ] || failed=$((failed + 1))
}

# Triton compiles every kernel specialisation on first use (seconds each): xdist workers compile in parallel, and
# pytest-timeout stops a single hung test instead of the whole step (both ship with the device image)
PYTEST_FLAGS=(-q -p no:cacheprovider --durations=15)
"$PY" -c "import xdist" 2>/dev/null && PYTEST_FLAGS+=(-n 4)
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_FLAGS+=(--timeout=120)

# the limits add up to under 12 minutes; a typical run takes about half
step environment 40 "$PY" -c "
import torch, triton, transformers, vtc, vtc_kernels, vtc_plugins
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')
print('vtc_kernels from', vtc_kernels.__file__)
"
step kernel-tests 170 "$PY" -m pytest "${PYTEST_FLAGS[@]}" tests/test_kernels*.py tests/test_bench_kernels.py
step bench-kernels 100 "$PY" -m vtc.tools.cli bench-kernels --device cuda --repeats 10 \
    --json "$OUT/bench-kernels-cuda.json"
step prefill 150 "$PY" eval/gpu_prefill.py --json "$OUT/prefill.json"
# reads step 3's timings (no second 7B build); its own check runs a demo-size model for seconds
step attention 60 "$PY" eval/gpu_attention.py --prefill-json "$OUT/prefill.json" --json "$OUT/attention.json"
step encode 150 "$PY" eval/gpu_encode.py --json "$OUT/encode.json"

rm -rf "$SITE"
echo "=== $failed step(s) failed; results in $OUT"
exit $failed
