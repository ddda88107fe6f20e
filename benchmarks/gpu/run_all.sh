#!/usr/bin/env bash
# The GPU kit's entry point (benchmarks/gpu/README.md says which bundles each part carries and how to call it).
#
#   bash benchmarks/gpu/run_all.sh PART          # PART 1..6, on the GPU machine: files under $OUT
#   bash benchmarks/gpu/run_all.sh --dry-run [PART ...]   # here, on CPU: every part's scripts, configs and commands
#
# On the GPU machine: installs the carried wheel bundles (.whl/*/) into /tmp/site, puts /tmp/site, src/ (anyfit
# from this source tree: pip would drag in torch and transformers >= 5.18 otherwise) and this folder on
# PYTHONPATH, and runs the part within 9 minutes (`timeout`); the part itself stops starting new work a minute
# before, and writes results as it goes, so what was measured comes back even if it is killed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KIT=$ROOT/benchmarks/gpu
PART_LIMIT=${PART_LIMIT:-540}  # seconds: a device call may run 600
declare -A SCRIPT=([1]=part1_smoke.py [2]=part2_speed.py [3]=part3_plan.py [4]=part4_sharding.py [5]=part5_long.py
    [6]=part6_new_paths.py)
declare -A NEEDS=([1]="core bnb" [2]="core" [3]="core bnb" [4]="core deepspeed" [5]="core" [6]="core fla")

install_wheels() {  # the carried bundles into /tmp/site; pyarrow only where the machine's is older than 24
    local wheels=() bundle missing=()
    for bundle in ${NEEDS[$1]}; do
        [ -d "$ROOT/.whl/$bundle" ] || missing+=("$bundle")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "[run_all] WARNING: part $1 needs the wheel bundle(s) '${missing[*]}', not carried (carry .whl/NAME);"
        echo "[run_all] WARNING: the cells that import them will fail"
    fi
    for bundle in "$ROOT"/.whl/*/; do
        [ "$(basename "$bundle")" = pyarrow ] && continue
        wheels+=("$bundle"*.whl)
    done
    if ! python3 -c 'import pyarrow, sys; sys.exit(int(pyarrow.__version__.split(".")[0]) < 24)' 2>/dev/null; then
        if [ -d "$ROOT/.whl/pyarrow" ]; then
            wheels+=("$ROOT"/.whl/pyarrow/*.whl)
        else
            echo "[run_all] WARNING: this pyarrow is older than 24 (datasets 5.2 needs it): carry .whl/pyarrow"
        fi
    fi
    [ ${#wheels[@]} -eq 0 ] && return 0
    echo "[run_all] installing ${#wheels[@]} wheels into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${wheels[@]}"
}

gpu_part() {
    local part=$1 rc
    echo "[run_all] part $part on $(hostname) at $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    install_wheels "$part" || { echo "[run_all] wheel install failed"; exit 3; }
    export PYTHONPATH=/tmp/site:$ROOT/src:$KIT${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    python3 -c 'import torch, transformers; print("[run_all] torch", torch.__version__, "transformers",
        transformers.__version__, "cuda", torch.cuda.is_available())'
    timeout -k 15 "$PART_LIMIT" python3 "$KIT/${SCRIPT[$part]}" --out "$OUT" --budget $((PART_LIMIT - 60))
    rc=$?
    [ $rc -eq 124 ] && echo "[run_all] part $part killed at ${PART_LIMIT} s; results.json holds what was measured"
    # A file comes back only under 16 MiB: keep the end of any log that grew past that.
    find "$OUT" -type f -size +15M -exec sh -c 'tail -c 15000000 "$1" > "$1.tail" && mv "$1.tail" "$1"' _ {} \;
    echo "[run_all] part $part exit $rc; files: $(cd "$OUT" && ls | tr '\n' ' ')"
    return $rc
}

cell_counts() {  # "N cells: 3 pass, 5 checked" from a part's results.json
    python3 -c 'import collections, json, sys
cells = json.load(open(sys.argv[1]))["cells"]
counts = collections.Counter(c.get("status") for c in cells.values())
print(f"{len(cells)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))' "$1"
}

dry_run() {
    local out=${DRY_OUT:-/tmp/anyfit-gpu-kit-dry} parts=("$@") status=0 part rc t0 summary=()
    [ ${#parts[@]} -eq 0 ] && parts=(1 2 3 4 5 6)
    local py=(uv run --no-sync python)
    [ -n "${PYTHON:-}" ] && py=("$PYTHON")
    rm -rf "$out" /tmp/anyfit-gpu-kit/*-dry
    mkdir -p "$out"
    cd "$ROOT" || exit 1
    export PYTHONPATH=$ROOT/src:$KIT${PYTHONPATH:+:$PYTHONPATH}
    echo "[dry-run] kit: shell syntax, Python compile, anyfit_api imports"
    if bash -n "$KIT/run_all.sh" && bash -n "$KIT/wheels.sh" && "${py[@]}" -m py_compile "$KIT"/*.py \
            && "${py[@]}" "$KIT/anyfit_api.py" > "$out/anyfit_api.log" 2>&1; then
        summary+=("PASS  kit (scripts compile; anyfit_api: $(tail -1 "$out/anyfit_api.log"))")
    else
        cat "$out/anyfit_api.log" 2>/dev/null
        summary+=("FAIL  kit: a script does not compile or an anyfit_api import broke (see above)")
        status=1
    fi
    if [ -d "$ROOT/.whl" ]; then
        if bash "$KIT/wheels.sh" --check > "$out/wheels.log" 2>&1; then
            summary+=("PASS  wheel bundles ($(tail -1 "$out/wheels.log"))")
        else
            summary+=("FAIL  wheel bundles: $(grep -m1 OVER "$out/wheels.log")"); status=1
        fi
    else
        summary+=("SKIP  wheel bundles: no .whl/ here (bash benchmarks/gpu/wheels.sh builds it)")
    fi
    for part in "${parts[@]}"; do
        echo "[dry-run] part $part: ${SCRIPT[$part]} --dry-run"
        t0=$SECONDS
        timeout 600 "${py[@]}" "$KIT/${SCRIPT[$part]}" --dry-run --out "$out/part$part" > "$out/part$part.log" 2>&1
        rc=$?
        if [ $rc -eq 0 ]; then
            summary+=("PASS  part $part ($((SECONDS - t0)) s; $(cell_counts "$out/part$part/results.json"))")
        else
            grep -E '^\[part[0-9]\] .*(fail|Error)' "$out/part$part.log" | head -20
            tail -5 "$out/part$part.log"
            summary+=("FAIL  part $part (exit $rc, $((SECONDS - t0)) s): log $out/part$part.log")
            status=1
        fi
    done
    echo
    printf '%s\n' "${summary[@]}"
    echo "[dry-run] $([ $status -eq 0 ] && echo PASS || echo FAIL): outputs in $out"
    return $status
}

case "${1:-}" in
    --dry-run) shift; dry_run "$@" ;;
    1|2|3|4|5|6)
        : "${OUT:?run_all.sh PART writes under \$OUT (set by the device tool)}"
        mkdir -p "$OUT"
        gpu_part "$1" 2>&1 | tee -a "$OUT/part.log"
        exit "${PIPESTATUS[0]}" ;;
    *) echo "usage: $0 PART (1..6, on the GPU machine, with \$OUT set) | $0 --dry-run [PART ...]" >&2; exit 2 ;;
esac
