#!/usr/bin/env bash
# inject_failure.sh: kill (or freeze) every training process of one node of a running Slurm job.
#
#   scripts/inject_failure.sh --job JOBID (--node NAME | --node-index I)
#       (--at-seconds T | --at-iteration N --log-dir DIR) [--signal KILL|STOP] [--pattern REGEX]
#
# --node-index I counts the job's nodes from 0 in Slurm's order (node I holds ranks I*G..);
# --at-iteration waits until a task log in DIR (task-*.log, as deadpool_launch.sh writes them)
# prints "iteration N"; --at-seconds waits T seconds. The kill runs on the node itself as a job
# step sharing the allocation (`srun --overlap --nodelist=NODE pkill`), no ssh needed.
# --signal STOP freezes the processes instead, as a hung GPU or NIC would (found by the
# heartbeat timeout). The default pattern matches the Python workers' command lines only -
# never srun's or this script's, which contain the module names too.
# DEADPOOL_DRY_RUN=1 prints the kill command instead of waiting and running it.
set -euo pipefail

die() {
    echo "inject_failure: error: $*" >&2
    exit 2
}

usage() {
    sed -n '3,5p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

job=${SLURM_JOB_ID:-}
node=
node_index=
at_seconds=
at_iteration=
log_dir=
signal=KILL
pattern='^[^ ]*python[^ ]* (-[^ ]+ )*-m megatron_deadpool\.(embedded\.worker|megatron_lm)( |$)'
while (($#)); do
    case $1 in
    --job) job=${2:?}; shift 2 ;;
    --node) node=${2:?}; shift 2 ;;
    --node-index) node_index=${2:?}; shift 2 ;;
    --at-seconds) at_seconds=${2:?}; shift 2 ;;
    --at-iteration) at_iteration=${2:?}; shift 2 ;;
    --log-dir) log_dir=${2:?}; shift 2 ;;
    --signal) signal=${2:?}; shift 2 ;;
    --pattern) pattern=${2:?}; shift 2 ;;
    -h | --help) usage ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
done

[ -n "$job" ] || die "--job JOBID is required (or run inside the job: SLURM_JOB_ID)"
[ -n "$node$node_index" ] || die "give --node NAME or --node-index I"
[ -z "$node" ] || [ -z "$node_index" ] || die "give only one of --node and --node-index"
[ -n "$at_seconds$at_iteration" ] || die "give --at-seconds T or --at-iteration N"
[ -z "$at_seconds" ] || [ -z "$at_iteration" ] ||
    die "give only one of --at-seconds and --at-iteration"
[ -z "$at_seconds" ] || [[ $at_seconds =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--at-seconds: a number"
[ -z "$at_iteration" ] || [[ $at_iteration =~ ^[0-9]+$ ]] || die "--at-iteration: an integer"
[ -z "$node_index" ] || [[ $node_index =~ ^[0-9]+$ ]] || die "--node-index: an integer"
[ -z "$at_iteration" ] || [ -n "$log_dir" ] || die "--at-iteration needs --log-dir DIR"
case $signal in KILL | STOP | TERM) ;; *) die "--signal must be KILL, STOP or TERM" ;; esac

expand_nodelist() { # a Slurm node list as one name per line (scontrol when present)
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$1"
        return
    fi
    local rest=$1 item prefix ranges range lo hi i
    while [ -n "$rest" ]; do # split on commas outside brackets
        if [[ $rest =~ ^([^,\[]*(\[[^]]*\])?)(,(.*))?$ ]]; then
            item=${BASH_REMATCH[1]}
            rest=${BASH_REMATCH[4]}
        else
            die "cannot parse node list '$1'"
        fi
        if [[ $item =~ ^([^\[]*)\[([^]]*)\]$ ]]; then
            prefix=${BASH_REMATCH[1]}
            IFS=, read -r -a ranges <<<"${BASH_REMATCH[2]}"
            for range in "${ranges[@]}"; do
                lo=${range%-*}
                hi=${range#*-}
                for ((i = 10#$lo; i <= 10#$hi; i++)); do
                    printf '%s%0*d\n' "$prefix" "${#lo}" "$i"
                done
            done
        else
            echo "$item"
        fi
    done
}

if [ -n "$node_index" ]; then
    if [ -n "${SLURM_JOB_NODELIST:-}" ] && [ "$job" = "${SLURM_JOB_ID:-}" ]; then
        nodelist=$SLURM_JOB_NODELIST
    else
        nodelist=$(squeue -h -j "$job" -o %N) || die "cannot list the nodes of job $job"
    fi
    node=$(expand_nodelist "$nodelist" | sed -n "$((node_index + 1))p")
    [ -n "$node" ] || die "job $job has no node with index $node_index ($nodelist)"
fi

kill_cmd=(srun --jobid="$job" --overlap --nodelist="$node" --nodes=1 --ntasks=1
    pkill "-$signal" -f "$pattern")

if [ "${DEADPOOL_DRY_RUN:-0}" = 1 ]; then
    printf 'DRY-RUN kill:'
    printf ' %q' "${kill_cmd[@]}"
    printf '\n'
    exit 0
fi

if [ -n "$at_seconds" ]; then
    sleep "$at_seconds"
    when="after ${at_seconds} s"
else
    regex="iteration[[:space:]]+${at_iteration}([^0-9]|$)"
    until grep -Eqs "$regex" "$log_dir"/task-*.log; do
        sleep 1
    done
    when="at iteration $at_iteration"
fi
echo "inject_failure: $(date +%T) SIG$signal to the training processes of $node $when"
"${kill_cmd[@]}" || echo "inject_failure: pkill found nothing to signal on $node" >&2
