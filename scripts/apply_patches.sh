#!/usr/bin/env bash
# Apply DeadPool's Megatron-LM patches (patches/megatron-lm/<tag>/*.patch) to a Megatron-LM tree.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR            apply (a no-op if already applied)
#   scripts/apply_patches.sh MEGATRON_LM_DIR --check    only check that they apply cleanly
#   scripts/apply_patches.sh MEGATRON_LM_DIR --reverse  take them out again
#
# The release is read from the tree itself (megatron/core/package_info.py: MAJOR.MINOR) and
# picks patches/megatron-lm/core_vMAJOR.MINOR.*/ (one per supported series: core_v0.16.1,
# core_v0.19.0); a tree of any other series is refused. The patches only make the hooks
# explicit: the zero-edit runner (python -m megatron_deadpool.megatron_lm pretrain_gpt.py ...)
# needs none of them.
set -euo pipefail

usage() {
    echo "usage: $0 MEGATRON_LM_DIR [--check|--reverse]" >&2
    exit 2
}

[[ $# -ge 1 && $# -le 2 ]] || usage
dir=$1
mode=${2:-apply}
case "$mode" in
    apply | --check | --reverse) ;;
    *) usage ;;
esac

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
info="$dir/megatron/core/package_info.py"
if [[ ! -f "$info" ]]; then
    echo "error: $dir is not a Megatron-LM tree (no megatron/core/package_info.py)" >&2
    exit 2
fi
part() { sed -n "s/^$1 *= *\([0-9][0-9]*\).*/\1/p" "$info" | head -n 1; }
major=$(part MAJOR)
minor=$(part MINOR)
patch=$(part PATCH)
if [[ -z "$major" || -z "$minor" || -z "$patch" ]]; then
    echo "error: cannot read the version from $info" >&2
    exit 2
fi
# One folder of patches per release series, named by the tag they were made for (tag
# core_v0.19.0's package_info.py reads 0.19.1): core_v$major.$minor.*
shopt -s nullglob
series=("$here"/patches/megatron-lm/core_v"$major.$minor".*)
if [[ ${#series[@]} -ne 1 ]]; then
    supported=$(cd "$here/patches/megatron-lm" && ls -d core_v* 2>/dev/null | paste -sd, - | sed 's/,/, /g')
    echo "error: Megatron-LM $major.$minor.$patch (core_v$major.$minor.$patch) is not supported" \
        "by these patches; supported tags: ${supported:-none}." >&2
    exit 3
fi
pdir=${series[0]}
tag=$(basename "$pdir")
patches=("$pdir"/*.patch)
if [[ ${#patches[@]} -eq 0 ]]; then
    echo "error: no patches in $pdir" >&2
    exit 3
fi

cd "$dir"
# A tree inside some other git work tree (vendored, not a submodule) must not be treated as
# part of it: git apply would take the patch's paths from that tree's top and skip them.
GIT_CEILING_DIRECTORIES=$(dirname "$(pwd -P)")
export GIT_CEILING_DIRECTORIES
for p in "${patches[@]}"; do
    name=$(basename "$p")
    if git apply --reverse --check "$p" 2>/dev/null; then
        applied=1
    else
        applied=0
    fi
    case "$mode" in
        --check)
            if [[ $applied -eq 1 ]]; then
                echo "$name: already applied ($tag)"
            else
                git apply --check "$p"
                echo "$name: applies cleanly ($tag)"
            fi
            ;;
        --reverse)
            if [[ $applied -eq 1 ]]; then
                git apply --reverse "$p"
                echo "$name: reverted ($tag)"
            else
                echo "$name: not applied ($tag)"
            fi
            ;;
        apply)
            if [[ $applied -eq 1 ]]; then
                echo "$name: already applied ($tag)"
            else
                git apply "$p"
                echo "$name: applied ($tag)"
            fi
            ;;
    esac
done
