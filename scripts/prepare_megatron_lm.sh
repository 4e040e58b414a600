#!/usr/bin/env bash
# Prepare Megatron-LM source trees for DeadPool's integration tests and print MEGATRON_LM_PATH.
#
#   scripts/prepare_megatron_lm.sh SRC [DEST]
#
# SRC holds one Megatron-LM tree per tag (SRC/core_v0.16.1, SRC/core_v0.19.0, ...), e.g. the
# read-only exports in ../shared/megatron-lm. Each tree is copied to DEST/<tag> (default
# ${XDG_CACHE_HOME:-~/.cache}/megatron-deadpool/megatron-lm; an up-to-date copy is kept) and
# its dataset helpers (megatron/core/datasets/helpers_cpp) are built there with the Python
# that will train: $PYTHON, else the python3 on PATH, which needs pybind11 (pip install -e
# '.[megatron-lm]'). Prints the prepared trees joined by ':' - the value for MEGATRON_LM_PATH -
# or nothing when SRC holds no tree. Progress goes to stderr.
set -euo pipefail

[[ $# -ge 1 && $# -le 2 ]] || { echo "usage: $0 SRC [DEST]" >&2; exit 2; }
src=$1
dest=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-deadpool/megatron-lm}
python=$(command -v "${PYTHON:-python3}")
bindir=$(cd "$(dirname "$python")" && pwd)  # absolute: make runs in the tree
suffix=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")

trees=()
shopt -s nullglob
for tree in "$src"/core_v*/; do
    tree=${tree%/}
    [[ -f "$tree/pretrain_gpt.py" && -f "$tree/megatron/core/package_info.py" ]] || continue
    tag=$(basename "$tree")
    copy="$dest/$tag"
    if ! [[ -d "$copy" ]] || ! diff -rq --exclude=__pycache__ --exclude='helpers_cpp*' \
        "$tree" "$copy" >/dev/null 2>&1; then
        echo "copying $tree to $copy" >&2
        rm -rf "$copy"
        mkdir -p "$dest"
        cp -R "$tree" "$copy"
        chmod -R u+w "$copy"
    fi
    echo "building the dataset helpers of $copy ($suffix)" >&2
    (cd "$copy/megatron/core/datasets" && PATH="$bindir:$PATH" make -s LIBEXT="$suffix" >&2)
    trees+=("$copy")
done
(IFS=:; echo "${trees[*]}")
