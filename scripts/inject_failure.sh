#!/usr/bin/env bash
# inject_failure.sh: kill (or freeze) every process of one Slurm job on one of its nodes.
#
#   scripts/inject_failure.sh --job JOBID (--node NAME | --node-index I)
#       (--at-seconds T | --at-iteration N --log-dir DIR) [--signal KILL|STOP|TERM]
#
# --node-index I counts the job's nodes from 0 in Slurm's order (node I holds ranks I*G..);
# --at-iteration waits until a task log in DIR (task-*.log, as deadpool_launch.sh writes them)
# prints "iteration N/" (the embedded job's workers log "iteration N/TOTAL | loss ..." on every
# rank, Megatron-LM "iteration      N/  TOTAL |"); --at-seconds waits T seconds.
# The signal is sent on the node itself, by a job step sharing the allocation (`srun --overlap
# --nodelist=NODE`, no ssh), to the processes Slurm itself lists for this job there (`scontrol
# listpids JOBID`): the tasks of the job's steps, never another job's processes. Left alone: the
# batch step (batch script, srun, coordinator on the first node), the extern step, and the
# injecting step itself.
# --signal STOP freezes them instead, as a hung GPU or NIC would (found by the heartbeat timeout).
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
while (($#)); do
    case $1 in
    --job) job=${2:?}; shift 2 ;;
    --node) node=${2:?}; shift 2 ;;
    --node-index) node_index=${2:?}; shift 2 ;;
    --at-seconds) at_seconds=${2:?}; shift 2 ;;
    --at-iteration) at_iteration=${2:?}; shift 2 ;;
    --log-dir) log_dir=${2:?}; shift 2 ;;
    --signal) signal=${2:?}; shift 2 ;;
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

# Runs on NODE as its own step ($0: the signal), in one line so that dry runs print it so.
# listpids prints "PID JOBID STEPID LOCALID GLOBALID" for each process of the job on the node.
# shellcheck disable=SC2016 # expanded by the step on NODE
{
    signal_job='pids=$(scontrol listpids "$SLURM_JOB_ID" | awk -v me="$SLURM_STEP_ID"'
    signal_job+=" 'NR > 1 && \$3 != me && \$3 != \"batch\" && \$3 != \"extern\" { print \$1 }');"
    signal_job+=' if [ -z "$pids" ]; then echo "no process of job $SLURM_JOB_ID on $(hostname)" >&2;'
    signal_job+=' exit 3; fi; echo "SIG$0 to" $pids; kill -s "$0" $pids'
}
kill_cmd=(srun --jobid="$job" --overlap --nodelist="$node" --nodes=1 --ntasks=1
    bash -c "$signal_job" "$signal")

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
    regex="iteration[[:space:]]+${at_iteration}/"
    until grep -Eqs "$regex" "$log_dir"/task-*.log; do
        sleep 0.2
    done
    when="at iteration $at_iteration"
fi
echo "inject_failure: $(date +%T.%N) SIG$signal to job $job's processes on $node $when"
"${kill_cmd[@]}" || echo "inject_failure: nothing signalled on $node (status $?)" >&2
