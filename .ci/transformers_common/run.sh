#!/usr/bin/env bash
# Runs transformers' shared CausalLM model tests against LEX in one configuration.
#   .ci/transformers_common/run.sh [default|small_window|llama|qwen3|qwen3_sliding|gemma3] [extra pytest args...]
# Builds the out-of-tree checkout with /work/shared/transformers-common-tests/setup.sh if needed (into $TCT,
# default /tmp/tct), copies test_modeling_lex.py to $T/tests/models/lex/ and runs pytest from $T.
# Python: $PYTHON, else the repo's .venv, else python on PATH. No xdist: one process. An existing $PYTHONPATH is
# kept after the checkout and the repo (e.g. a --target folder holding the test dependencies).
set -euo pipefail
CONFIG=${1:-default}
shift || true
CONFIGS="default small_window llama qwen3 qwen3_sliding gemma3"
case " $CONFIGS " in *" $CONFIG "*) ;; *) echo "unknown config '$CONFIG' (one of: $CONFIGS)" >&2; exit 2;; esac

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SETUP=${SETUP:-$REPO/../shared/transformers-common-tests/setup.sh}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python; fi
fi
# setup.sh calls pip: the one next to $PYTHON
PATH=$(dirname "$PYTHON"):$PATH
export PATH

T=${TCT:-/tmp/tct}
if [ ! -d "$T/src/transformers" ] || [ ! -f "$T/tests/causal_lm_tester.py" ]; then
  T=$(bash "$SETUP" "$T" | tail -n 1)
fi
mkdir -p "$T/tests/models/lex"
touch "$T/tests/models/__init__.py" "$T/tests/models/lex/__init__.py"
cp "$HERE/test_modeling_lex.py" "$T/tests/models/lex/test_modeling_lex.py"

cd "$T"
echo "+ LEX_COMMON_CONFIG=$CONFIG ($T, repo $REPO)"
HF_HUB_OFFLINE=1 LEX_COMMON_CONFIG=$CONFIG PYTHONPATH=$T:$REPO${PYTHONPATH:+:$PYTHONPATH} \
  "$PYTHON" -m pytest tests/models/lex -q -p no:cacheprovider --timeout 300 -p lex_intree_names -rf -n 0 "$@"
