#!/usr/bin/env bash
# deadpool_launch.sh: start a DeadPool job inside a Slurm allocation of N active + S spare nodes.
#
# Called by scripts/slurm/<site>.sbatch once they have set the site's defaults; usable by hand
# inside any allocation (salloc) as well. It
#   1. loads $DEADPOOL_MODULES and activates $DEADPOOL_VENV if set;
#   2. starts the coordinator (store host, heartbeat monitor, spare assignment) on this host,
#      in the background, unless DEADPOOL_COORDINATOR names one already running, and a standby
#      coordinator on the allocation's last node (a spare node: it trains only after a failure,
#      and it is not the batch host) that takes the job over if this host is lost. Both get
#      the job's own settings (DEADPOOL_CONFIG, the workers' --deadpool-* flags), and the one
#      that ends the job ends the Slurm job too (scripts/slurm/deadpool_coordinator.sh);
#   3. starts one process per GPU on every node with one `srun` that keeps the survivors alive
#      when processes or nodes die (--kill-on-bad-exit=0, --no-kill, --wait=0). Tasks are laid
#      out in blocks, so node i holds ranks i*G .. i*G+G-1; tasks >= the world size (the last
#      SPARE_NODES nodes) are the spares. Each task gets RANK/LOCAL_RANK from SLURM_PROCID/
#      SLURM_LOCALID and `--deadpool-coordinator HOST:PORT`;
#   4. optionally starts scripts/inject_failure.sh with $DEADPOOL_INJECT.
# With DEADPOOL_DRY_RUN=1 it prints the environment and command lines instead of running them.
#
# Variables (all optional; defaults after ':='):
#   SPARE_NODES         spare nodes at the end of the allocation                    (1)
#   GPUS_PER_NODE       processes per node = GPUs per node                          (site)
#   DEADPOOL_MODE       embedded: python -m megatron_deadpool.embedded.worker --config ...
#                       megatron-lm: python -m megatron_deadpool.megatron_lm
#                         $MEGATRON_LM_PATH/pretrain_gpt.py $MEGATRON_ARGS --deadpool ...
#                       baseline: plain Megatron-LM (python pretrain_gpt.py $MEGATRON_ARGS) on
#                         the active nodes only, no coordinator, no spares: the reference
#                         for the overhead measurement
#                       selftest: `deadpool selftest --slurm` over the allocation (replication,
#                         a killed and a frozen peer replaced, the device checks); its report
#                         in $DEADPOOL_LOG_DIR/selftest.json, its exit code the job's  (embedded)
#   DEADPOOL_CONFIG     job config of the embedded job                   (configs/cpu-demo.yaml)
#   MEGATRON_LM_PATH    Megatron-LM checkout (megatron-lm mode)
#   Megatron-LM's arguments (megatron-lm and baseline modes), one of:
#     - this script's own arguments (a bash array keeps its quoting):
#         args=(--num-layers 32 --data-path "/scratch/my corpus/text_document" ...)
#         sbatch scripts/slurm/vista.sbatch "${args[@]}"
#     MEGATRON_ARGS_FILE  a file of arguments, one per line (no quoting needed: a line is one
#                       argument, spaces and all; empty lines and lines starting with # skipped)
#     MEGATRON_ARGS       a string split on whitespace: only for arguments without quotes or
#                       spaces (a quote in it is refused: use the file or the array)
#   DEADPOOL_REPLICAS   replicas k of each optimizer shard                           (1)
#   DEADPOOL_RESPAWN_LIMIT  N > 0: one `deadpool agent` per node (a job step of its own per
#                       node) starts that node's processes and respawns a crashed or hung one in
#                       place, N times per node within --deadpool-respawn-window (600 s), with
#                       no spare spent (with DEADPOOL_JOIN: the joining nodes' agents join the
#                       job); 0: one srun task per GPU, every failure takes a spare
#                       (2 in the embedded and megatron-lm modes, 0 in the others)
#   DEADPOOL_EXTRA_ARGS more --deadpool-* flags for every worker, split on whitespace
#   DEADPOOL_PORT       coordinator port                                             (29400)
#   DEADPOOL_COORDINATOR HOST:PORT of a coordinator started elsewhere (then none here); a
#                       list HOST:PORT,HOST:PORT names its standbys too
#   DEADPOOL_JOIN       HOST:PORT[,HOST:PORT] of a running job's coordinators: instead of
#                       starting a job, every task of this allocation joins that job as a
#                       spare (--deadpool-join; a repaired node, or nodes of another
#                       allocation). Needs the job's secret: DEADPOOL_JOB_TOKEN_FILE=<the
#                       job's DEADPOOL_LOG_DIR>/job.token, and its run id DEADPOOL_JOB_ID
#                       (the job prints the whole command)
#   DEADPOOL_JOB_ID     the run's id, which every value of its stores is sealed for: a value
#                       copied from another run with the same secret (a requeued job, a kept
#                       token file) is refused (slurm-<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>
#                       when this script starts the coordinator; else as given, none if unset)
#   DEADPOOL_STANDBY    HOST:PORT of the standby coordinator, "none" for none
#                       (the allocation's last node, DEADPOOL_PORT; none on one node)
#   DEADPOOL_END_GRACE  seconds the tasks get to end on their own once the coordinator
#                       that ended the job exited, before the job is cancelled         (60)
#   DEADPOOL_NODE_DOWN_WAIT  with no coordinator left (the primary's and the standby's
#                       nodes both lost), how long a task that saved what it held waits
#                       for Slurm to report their hosts not responding before it
#                       cancels the job (after DEADPOOL_END_GRACE); no verdict, no cancel (600)
#   MASTER_PORT         torch.distributed port                                      (29500)
#   OMP_NUM_THREADS     OpenMP threads of each process, as torchrun sets it              (1)
#   DEADPOOL_LOG_DIR    per-job logs: coordinator.log, task-<rank>.log   (logs/<name>-<jobid>)
#   DEADPOOL_MODULES    modules to load, space separated                            (site)
#   DEADPOOL_VENV       virtual environment to activate
#   DEADPOOL_SITE_ENV   names of the site's network/NCCL variables to pass on       (site)
#   SRUN_EXTRA_ARGS     more srun flags, split on whitespace                        (site)
#   PYTHON              Python interpreter, or a wrapper that runs it in a container
#                       (docs/how-to/containers.md); every process uses it     (python)
#   DEADPOOL_COORDINATOR_PYTHON  the coordinators' Python (the primary on this host, the
#                       standby in its own job step): the host's when only the workers and
#                       agents run in a container (pyxis' --container-image in
#                       SRUN_EXTRA_ARGS, which the standby's step does not get)      (PYTHON)
#   DEADPOOL_INJECT     arguments for scripts/inject_failure.sh, e.g.
#                       "--node-index 1 --at-iteration 20"; empty: no injected failure
#   DEADPOOL_DRY_RUN    1: print instead of running                                  (0)
set -euo pipefail

die() {
    echo "deadpool_launch: error: $*" >&2
    exit 2
}

dry_run() { [ "${DEADPOOL_DRY_RUN:-0}" = 1 ]; }

show() { # show WHAT CMD...: the command line, shell-quoted, as one line
    local what=$1
    shift
    printf 'DRY-RUN %s:' "$what"
    printf ' %q' "$@"
    printf '\n'
}

: "${DEADPOOL_HOME:=${SLURM_SUBMIT_DIR:-$PWD}}"
: "${SPARE_NODES:=1}"
: "${GPUS_PER_NODE:=${SLURM_NTASKS_PER_NODE:-1}}"
: "${DEADPOOL_MODE:=embedded}"
: "${DEADPOOL_CONFIG:=configs/cpu-demo.yaml}"
: "${MEGATRON_LM_PATH:=}"
: "${MEGATRON_ARGS:=}"
: "${MEGATRON_ARGS_FILE:=}"
: "${DEADPOOL_REPLICAS:=1}"
# In-place respawn by default where agents can run the job (`deadpool agent`); see above.
case $DEADPOOL_MODE in embedded | megatron-lm) : "${DEADPOOL_RESPAWN_LIMIT:=2}" ;; *)
    : "${DEADPOOL_RESPAWN_LIMIT:=0}" ;;
esac
: "${DEADPOOL_EXTRA_ARGS:=}"
: "${DEADPOOL_PORT:=29400}"
: "${DEADPOOL_COORDINATOR:=}"
: "${DEADPOOL_STANDBY:=}"
: "${DEADPOOL_JOIN:=}"
: "${DEADPOOL_END_GRACE:=60}"
: "${DEADPOOL_NODE_DOWN_WAIT:=600}"
export DEADPOOL_END_GRACE DEADPOOL_NODE_DOWN_WAIT # the tasks read them too
: "${MASTER_PORT:=29500}"
: "${DEADPOOL_LOG_DIR:=$DEADPOOL_HOME/logs/${SLURM_JOB_NAME:-deadpool}-${SLURM_JOB_ID:-0}}"
: "${DEADPOOL_MODULES:=}"
: "${DEADPOOL_VENV:=}"
: "${DEADPOOL_SITE_ENV:=}"
: "${SRUN_EXTRA_ARGS:=}"
: "${PYTHON:=python}"
: "${DEADPOOL_COORDINATOR_PYTHON:=$PYTHON}"
: "${DEADPOOL_INJECT:=}"

# The folder of scripts/ this launcher is in: the repository's, or the installed package's copy
# (megatron_deadpool/resources/scripts) when the job was submitted without a clone.
scripts_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$DEADPOOL_HOME" || die "DEADPOOL_HOME=$DEADPOOL_HOME: no such directory (submit from the repo)"
# Without a clone, the default config is the package's copy.
packaged_config=$scripts_dir/../$DEADPOOL_CONFIG
if [[ $DEADPOOL_CONFIG == configs/* && ! -e $DEADPOOL_CONFIG && -e $packaged_config ]]; then
    DEADPOOL_CONFIG=$packaged_config
fi

nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}
[ -n "$nnodes" ] || die "not inside a Slurm allocation (SLURM_JOB_NUM_NODES is unset)"
for name in nnodes SPARE_NODES GPUS_PER_NODE DEADPOOL_REPLICAS DEADPOOL_PORT MASTER_PORT \
    DEADPOOL_END_GRACE DEADPOOL_NODE_DOWN_WAIT DEADPOOL_RESPAWN_LIMIT; do
    [[ ${!name} =~ ^[0-9]+$ ]] || die "$name must be a non-negative integer, got '${!name}'"
done
if [ -n "$DEADPOOL_JOIN" ]; then
    [ -z "$DEADPOOL_COORDINATOR" ] || die "DEADPOOL_JOIN and DEADPOOL_COORDINATOR: give one"
    [ -z "$DEADPOOL_INJECT" ] || die "DEADPOOL_INJECT: a joining allocation injects nothing"
    case $DEADPOOL_MODE in embedded | megatron-lm) ;; *)
        die "DEADPOOL_JOIN: DEADPOOL_MODE must be embedded or megatron-lm, got '$DEADPOOL_MODE'"
        ;;
    esac
    [ -n "${DEADPOOL_JOB_TOKEN:-}${DEADPOOL_JOB_TOKEN_FILE:-}" ] ||
        die "DEADPOOL_JOIN needs the running job's secret: DEADPOOL_JOB_TOKEN_FILE=<its" \
            "DEADPOOL_LOG_DIR>/job.token"
    [ -n "${DEADPOOL_JOB_ID+set}" ] ||
        die "DEADPOOL_JOIN needs the running job's run id: DEADPOOL_JOB_ID=<the id it printed>" \
            "(empty if its coordinator was given none)"
    SPARE_NODES=0 # every node of this allocation joins as spares
fi
active_nodes=$((nnodes - SPARE_NODES))
((active_nodes >= 1)) || die "$nnodes node(s) leave no active node after SPARE_NODES=$SPARE_NODES"
((GPUS_PER_NODE >= 1)) || die "GPUS_PER_NODE must be >= 1"
world=$((active_nodes * GPUS_PER_NODE))
spares=$((SPARE_NODES * GPUS_PER_NODE))
ntasks=$((nnodes * GPUS_PER_NODE))

if [ -n "$DEADPOOL_COORDINATOR$DEADPOOL_JOIN" ]; then
    coordinator=${DEADPOOL_COORDINATOR:-$DEADPOOL_JOIN}
    start_coordinator=0
else
    coordinator="$(hostname):$DEADPOOL_PORT"
    start_coordinator=1
    if [ -z "$DEADPOOL_STANDBY" ] && ((nnodes > 1)); then
        # The last node: a spare node (it trains only after a failure), never the batch host.
        last=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | tail -n 1) ||
            last=
        [ -n "$last" ] || die "cannot list the allocation's nodes (scontrol show hostnames" \
            "\$SLURM_JOB_NODELIST); set DEADPOOL_STANDBY=HOST:PORT or DEADPOOL_STANDBY=none"
        DEADPOOL_STANDBY=$last:$DEADPOOL_PORT
    fi
    if [ -n "$DEADPOOL_STANDBY" ] && [ "$DEADPOOL_STANDBY" != none ]; then
        coordinator=$coordinator,$DEADPOOL_STANDBY
    fi
fi
primary=${coordinator%%,*}
coord_host=${primary%:*}
coord_port=${primary##*:}

# Everything srun passes on to the tasks (srun exports the whole environment).
export MASTER_ADDR=${MASTER_ADDR:-$coord_host}
export MASTER_PORT WORLD_SIZE=$world LOCAL_WORLD_SIZE=$GPUS_PER_NODE
# One OpenMP thread per process unless the site says otherwise, as torchrun sets it for more
# than one process per node: otherwise each of a node's processes starts a team of all its
# cores, and their spinning threads slow every CPU-side parallel op (measured on an H100 node:
# two processes checksumming 2 GiB each took 27 s instead of 0.5 s).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The job's secret, new for every job: it seals every value of the coordinator's store
# (megatron_deadpool/hotswap/protocol/seal.py). It reaches the coordinators and the tasks in their
# environment only (srun exports it), never on a command line; the one copy on disk is
# $DEADPOOL_LOG_DIR/job.token, readable by its owner only, for nodes that join the job later.
# A joining allocation uses the running job's (DEADPOOL_JOB_TOKEN_FILE, read by the tasks).
if [ -z "$DEADPOOL_JOIN" ]; then
    export DEADPOOL_JOB_TOKEN=${DEADPOOL_JOB_TOKEN:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}
fi
# The run's id: every value of the job's stores is sealed for it as well, so that nothing copied
# from another run with the same secret (this job before a requeue, a kept token file) counts.
# New for every run of a coordinator this script starts; else the one given (the coordinator's).
if ((start_coordinator)); then
    export DEADPOOL_JOB_ID=${DEADPOOL_JOB_ID:-slurm-${SLURM_JOB_ID:-0}.${SLURM_RESTART_COUNT:-0}}
elif [ -n "${DEADPOOL_JOB_ID+set}" ]; then
    export DEADPOOL_JOB_ID
fi
for name in $DEADPOOL_SITE_ENV; do
    [ -n "${!name+set}" ] || die "site variable $name is listed in DEADPOOL_SITE_ENV but unset"
    export "${name?}"
done

# Modules and Python environment.
for module_name in $DEADPOOL_MODULES; do
    if dry_run; then
        show module module load "$module_name"
    else
        command -v module >/dev/null 2>&1 ||
            die "'module' is not available; set DEADPOOL_MODULES= to skip loading modules"
        module load "$module_name"
    fi
done
if [ -n "$DEADPOOL_VENV" ]; then
    if dry_run; then
        show venv source "$DEADPOOL_VENV/bin/activate"
    else
        # shellcheck disable=SC1091
        source "$DEADPOOL_VENV/bin/activate"
    fi
fi

# Megatron-LM's arguments: this script's own, MEGATRON_ARGS_FILE's lines or MEGATRON_ARGS's words.
megatron_argv=()
sources=0
(($# == 0)) || { megatron_argv=("$@"); sources=$((sources + 1)); }
if [ -n "$MEGATRON_ARGS_FILE" ]; then
    [ -f "$MEGATRON_ARGS_FILE" ] || die "MEGATRON_ARGS_FILE=$MEGATRON_ARGS_FILE: no such file"
    while IFS= read -r line || [ -n "$line" ]; do
        [[ -z $line || $line == \#* ]] || megatron_argv+=("$line")
    done <"$MEGATRON_ARGS_FILE"
    sources=$((sources + 1))
fi
if [ -n "$MEGATRON_ARGS" ]; then
    [[ $MEGATRON_ARGS != *[\"\']* ]] || die "MEGATRON_ARGS holds a quote, which a whitespace" \
        "split cannot honour: put one argument per line in MEGATRON_ARGS_FILE, or pass them as" \
        "this script's arguments (sbatch SCRIPT \"\${args[@]}\")"
    read -r -a words <<<"$MEGATRON_ARGS"
    megatron_argv+=("${words[@]}")
    sources=$((sources + 1))
fi
((sources <= 1)) || die "Megatron-LM arguments given $sources ways (script arguments," \
    "MEGATRON_ARGS_FILE, MEGATRON_ARGS): give one"
read -r -a extra_args <<<"$DEADPOOL_EXTRA_ARGS"
read -r -a srun_extra <<<"$SRUN_EXTRA_ARGS"
megatron_args=()
join_flag=()
[ -z "$DEADPOOL_JOIN" ] || join_flag=(--deadpool-join)
deadpool_flags=(
    "${join_flag[@]}"
    --deadpool-coordinator "$coordinator"
    --deadpool-spare-ranks "$spares"
    --deadpool-replicas "$DEADPOOL_REPLICAS"
    --deadpool-ranks-per-node "$GPUS_PER_NODE"
    --deadpool-log-dir "$DEADPOOL_LOG_DIR"
)
# Always said, 0 too: the coordinator and workers default to respawning (`DeadpoolConfig`).
deadpool_flags+=(--deadpool-respawn-limit "$DEADPOOL_RESPAWN_LIMIT")
# The coordinators judge the workers by the job's own settings: the embedded job's config and
# every --deadpool-* flag the workers get (each takes a value).
job_settings=("${deadpool_flags[@]}")
[ "$DEADPOOL_MODE" != embedded ] || job_settings+=(--config "$DEADPOOL_CONFIG")
worker_args=("${megatron_argv[@]}" "${extra_args[@]}")
for ((i = 0; i < ${#worker_args[@]}; i++)); do
    case ${worker_args[i]} in
    --deadpool-job-token*)
        die "pass the job's secret in DEADPOOL_JOB_TOKEN, not --deadpool-job-token: ps shows" \
            "command lines to everyone on the node"
        ;;
    --deadpool-*=*) job_settings+=("${worker_args[i]}") ;;
    --deadpool-*)
        job_settings+=("${worker_args[i]}" "${worker_args[i + 1]:-}")
        i=$((i + 1))
        ;;
    esac
done
case $DEADPOOL_MODE in
embedded)
    [ -f "$DEADPOOL_CONFIG" ] || die "DEADPOOL_CONFIG=$DEADPOOL_CONFIG: no such file"
    worker=("$PYTHON" -m megatron_deadpool.embedded.worker --config "$DEADPOOL_CONFIG"
        "${deadpool_flags[@]}" "${extra_args[@]}")
    ;;
megatron-lm | baseline)
    [ -n "$MEGATRON_LM_PATH" ] || die "DEADPOOL_MODE=$DEADPOOL_MODE needs MEGATRON_LM_PATH"
    ((${#megatron_argv[@]})) || die "DEADPOOL_MODE=$DEADPOOL_MODE needs Megatron-LM's" \
        "arguments: this script's arguments, MEGATRON_ARGS_FILE or MEGATRON_ARGS"
    megatron_args=("${megatron_argv[@]}")
    if [ "$DEADPOOL_MODE" = baseline ]; then
        worker=("$PYTHON" "$MEGATRON_LM_PATH/pretrain_gpt.py" "${megatron_args[@]}")
    else
        worker=("$PYTHON" -m megatron_deadpool.megatron_lm "$MEGATRON_LM_PATH/pretrain_gpt.py"
            "${megatron_args[@]}" --deadpool "${deadpool_flags[@]}" "${extra_args[@]}")
    fi
    ;;
selftest) ;;
*) die "DEADPOOL_MODE must be embedded, megatron-lm, baseline or selftest, got '$DEADPOOL_MODE'" ;;
esac
if [ "$DEADPOOL_MODE" = selftest ]; then # it starts its own job steps, one per check
    [ -z "$DEADPOOL_INJECT" ] || die "DEADPOOL_INJECT: the selftest injects its own failures"
    selftest_cmd=("$PYTHON" -m megatron_deadpool.cli selftest --slurm
        --nproc-per-node "$GPUS_PER_NODE" --spare-nodes "$SPARE_NODES"
        --run-dir "$DEADPOOL_LOG_DIR/selftest" --json "$DEADPOOL_LOG_DIR/selftest.json")
    export SRUN_EXTRA_ARGS
    if dry_run; then
        show selftest "${selftest_cmd[@]}"
        exit 0
    fi
    mkdir -p "$DEADPOOL_LOG_DIR"
    exec "${selftest_cmd[@]}"
fi
if [ "$DEADPOOL_MODE" = baseline ]; then # the same active GPUs, nothing else
    nnodes=$active_nodes
    ntasks=$world
    start_coordinator=0
fi

coordinator_cmd=(bash "$scripts_dir/slurm/deadpool_coordinator.sh" coordinator
    "$DEADPOOL_COORDINATOR_PYTHON" -m megatron_deadpool.cli coordinator --world-size "$world"
    "${job_settings[@]}")
standby_cmd=()
if ((start_coordinator)) && [ "$coordinator" != "$primary" ]; then
    standby_address=${coordinator#*,}
    standby_host=${standby_address%:*}
    # Its own job step on that node; its lines about the job's end go to the job's log (the
    # batch host, which writes it otherwise, may be gone).
    job_log=$(scontrol show job "${SLURM_JOB_ID:-0}" -o 2>/dev/null |
        sed -n 's/.* StdOut=\([^ ]*\).*/\1/p') || job_log=
    standby_cmd=(srun --overlap --nodes=1 --ntasks=1 --nodelist="$standby_host"
        --output="$DEADPOOL_LOG_DIR/standby-step.log"
        --export="ALL,DEADPOOL_JOB_LOG=${job_log:-$DEADPOOL_LOG_DIR/standby-step.log}"
        bash "$scripts_dir/slurm/deadpool_coordinator.sh" standby
        "$DEADPOOL_COORDINATOR_PYTHON" -m megatron_deadpool.cli coordinator --world-size "$world"
        "${job_settings[@]}" --standby)
fi

# One task per GPU; the survivors of a failure must keep running, so: no kill on a bad exit,
# no kill when a node fails, and no limit on how long srun waits after the first task ends.
cpus=()
[ -z "${SLURM_CPUS_PER_TASK:-}" ] || cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
# The task wrapper's $SLURM_PROCID/$SLURM_LOCALID expand in each task, not here.
# shellcheck disable=SC2016
srun_cmd=(srun --nodes="$nnodes" --ntasks="$ntasks" --ntasks-per-node="$GPUS_PER_NODE"
    --distribution=block --kill-on-bad-exit=0 --no-kill --wait=0 "${cpus[@]}"
    --output="$DEADPOOL_LOG_DIR/task-%t.log" "${srun_extra[@]}"
    bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID; exec "$@"' deadpool-task
    "${worker[@]}")

if ((DEADPOOL_RESPAWN_LIMIT > 0)); then
    case $DEADPOOL_MODE in embedded | megatron-lm) ;; *)
        die "DEADPOOL_RESPAWN_LIMIT: DEADPOOL_MODE must be embedded or megatron-lm, got" \
            "'$DEADPOOL_MODE'"
        ;;
    esac
    # One agent per node instead (its CPUs: the node's tasks'); it starts the node's processes
    # with their RANK/LOCAL_RANK and logs task-<t>.log, and respawns them (hotswap/launch/node_agent.py).
    # Each agent is a job step of its own, on its node: a node that comes back while its step
    # is still known (a revived node) makes srun abort the whole step ("io error and missing
    # step"), which would take every node's agent with it.
    mapfile -t agent_hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null)
    ((${#agent_hosts[@]} == nnodes)) || die "cannot list the allocation's $nnodes nodes" \
        "(scontrol show hostnames \$SLURM_JOB_NODELIST)"
    ((${#cpus[@]} == 0)) || cpus=(--cpus-per-task=$((SLURM_CPUS_PER_TASK * GPUS_PER_NODE)))
    agent_srun=(srun --nodes=1 --ntasks=1 --input=none --kill-on-bad-exit=0 --no-kill --wait=0
        "${cpus[@]}" "${srun_extra[@]}")
    agent_cmd=("$PYTHON" -m megatron_deadpool.cli agent --world-size "$world" "${job_settings[@]}")
fi

# agent_step I: node I's agent (its own job step), as a command line
agent_step() {
    printf '%s\0' "${agent_srun[@]}" --nodelist="${agent_hosts[$1]}" \
        --output="$DEADPOOL_LOG_DIR/agent-$1.log" "${agent_cmd[@]}" --node "$1" -- "${worker[@]}"
}

# verdict: the exit status of the coordinator that ended the job (the primary's, or the
# standby's once it took over), nothing before one did
verdict() {
    local status found=
    for status in "$DEADPOOL_LOG_DIR"/{coordinator,standby}.status; do
        if [ -f "$status" ] && [ "$(cat "$status")" != 5 ]; then
            found=$(cat "$status")
        fi
    done
    printf '%s' "$found"
}

# run_workers: the job's processes - one srun of one task per GPU, or one agent per node - and
# their highest exit status. Every agent ends on its own once the job is over, but the srun of
# a node that came back without its step (a revived node) can wait on for long: once the
# coordinators' verdict is in, the sruns left get DEADPOOL_END_GRACE / 4 seconds, then are
# ended (the job's state is the verdict, below).
run_workers() {
    if ((DEADPOOL_RESPAWN_LIMIT == 0)); then
        "${srun_cmd[@]}"
        return
    fi
    local i code status=0 step pids=() left since=
    for ((i = 0; i < nnodes; i++)); do
        mapfile -d '' -t step < <(agent_step "$i")
        "${step[@]}" &
        pids+=($!)
    done
    while true; do
        left=()
        for i in "${pids[@]}"; do
            ! kill -0 "$i" 2>/dev/null || left+=("$i")
        done
        ((${#left[@]})) || break
        if [ -z "$since" ] && [ -n "$(verdict)" ]; then
            since=$SECONDS
        elif [ -n "$since" ] && ((SECONDS - since > DEADPOOL_END_GRACE / 4)); then
            echo "deadpool_launch: ending ${#left[@]} agent step(s) left after the job ended"
            kill -KILL "${left[@]}" 2>/dev/null || true
            break
        fi
        sleep 1
    done
    for i in "${pids[@]}"; do
        wait "$i"
        code=$?
        ((code <= status)) || status=$code
    done
    return "$status"
}

inject_cmd=()
if [ -n "$DEADPOOL_INJECT" ]; then
    read -r -a inject_args <<<"$DEADPOOL_INJECT"
    inject_cmd=(bash "$scripts_dir/inject_failure.sh" --job "${SLURM_JOB_ID:-0}"
        --log-dir "$DEADPOOL_LOG_DIR" "${inject_args[@]}")
fi

[ "$DEADPOOL_MODE" != baseline ] || [ -z "$DEADPOOL_INJECT" ] ||
    die "DEADPOOL_INJECT needs DeadPool (DEADPOOL_MODE embedded or megatron-lm)"
echo "deadpool_launch: $nnodes nodes = $active_nodes active + $SPARE_NODES spare;" \
    "world size $world, $spares spare ranks, coordinator $coordinator, logs $DEADPOOL_LOG_DIR"

if dry_run; then
    for name in MASTER_ADDR MASTER_PORT WORLD_SIZE LOCAL_WORLD_SIZE OMP_NUM_THREADS \
        ${DEADPOOL_JOB_ID+DEADPOOL_JOB_ID} $DEADPOOL_SITE_ENV; do
        echo "DRY-RUN env: $name=${!name}"
    done
    ((start_coordinator == 0)) || show coordinator "${coordinator_cmd[@]}"
    ((${#standby_cmd[@]} == 0)) || show standby "${standby_cmd[@]}"
    ((${#inject_cmd[@]} == 0)) || show inject "${inject_cmd[@]}"
    if ((DEADPOOL_RESPAWN_LIMIT == 0)); then
        show workers "${srun_cmd[@]}"
    else
        for ((i = 0; i < nnodes; i++)); do
            mapfile -d '' -t step < <(agent_step "$i")
            show "agent $i" "${step[@]}"
        done
    fi
    exit 0
fi

mkdir -p "$DEADPOOL_LOG_DIR"
if ((start_coordinator)); then
    (umask 077 && printf '%s\n' "$DEADPOOL_JOB_TOKEN" >"$DEADPOOL_LOG_DIR/job.token")
    echo "deadpool_launch: to add nodes to this job as spares (a repaired node, another" \
        "allocation): DEADPOOL_JOIN=$coordinator DEADPOOL_JOB_ID=$DEADPOOL_JOB_ID" \
        "DEADPOOL_JOB_TOKEN_FILE=$DEADPOOL_LOG_DIR/job.token sbatch --nodes=N <this sbatch file>"
fi
coordinator_pid=
standby_pid=
inject_pid=
# shellcheck disable=SC2329 # called by the EXIT trap
cleanup() {
    [ -z "$inject_pid" ] || kill "$inject_pid" 2>/dev/null || true
    [ -z "$standby_pid" ] || kill "$standby_pid" 2>/dev/null || true
    [ -z "$coordinator_pid" ] || kill "$coordinator_pid" 2>/dev/null || true
}
trap cleanup EXIT

# answers HOST PORT PID: wait up to 60 s for HOST:PORT to accept a connection, while process
# PID (if given) runs; status 0 once it does.
answers() {
    local _
    for _ in $(seq 1 120); do
        if (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; then
            return 0
        fi
        [ -z "$3" ] || kill -0 "$3" 2>/dev/null || return 1
        sleep 0.5
    done
    return 1
}

if ((start_coordinator)); then
    rm -f "$DEADPOOL_LOG_DIR"/{coordinator,standby}.status
    export DEADPOOL_LOG_DIR DEADPOOL_END_GRACE # for deadpool_coordinator.sh
    "${coordinator_cmd[@]}" &
    coordinator_pid=$!
fi
# The standby starts alongside the primary (it waits for the primary to answer); the workers
# start only once it listens, so that it watches the primary before any rank depends on it.
if ((${#standby_cmd[@]})); then
    "${standby_cmd[@]}" &
    standby_pid=$!
fi
if [ "$DEADPOOL_MODE" != baseline ]; then
    answers "$coord_host" "$coord_port" "$coordinator_pid" ||
        die "the coordinator exited or did not answer at $primary within 60 s; see" \
            "$DEADPOOL_LOG_DIR/coordinator.log"
fi
if ((${#standby_cmd[@]})) && ! answers "$standby_host" "${standby_address##*:}" "$standby_pid"; then
    echo "deadpool_launch: WARNING: no standby coordinator answers at $standby_address (see" \
        "$DEADPOOL_LOG_DIR/standby.log, standby-step.log): the job runs without one, and a" \
        "loss of this node would end it" >&2
fi
if ((${#inject_cmd[@]})); then
    "${inject_cmd[@]}" >>"$DEADPOOL_LOG_DIR/inject.log" 2>&1 &
    inject_pid=$!
fi

set +e
run_workers
rc=$?
set -e
echo "deadpool_launch: srun exited with status $rc"
# srun reports the highest task status, so a run that survived killed processes ends non-zero
# too. The verdict is the active coordinator's (the primary's, or the standby's once it took
# over): 0 every rank finished, 3 out of redundancy; it exits within seconds of the last rank.
if ((start_coordinator)); then
    verdict=
    for _ in $(seq 1 60); do
        verdict=$(verdict)
        [ -z "$verdict" ] || break
        sleep 0.5
    done
    if [ -n "$verdict" ]; then
        rc=$verdict
        echo "deadpool_launch: the coordinator exited with status $rc" \
            "(see $DEADPOOL_LOG_DIR/coordinator.log, standby.log)"
    else
        echo "deadpool_launch: training did not finish (see $DEADPOOL_LOG_DIR/coordinator.log)"
        ((rc != 0)) || rc=1
    fi
fi
exit "$rc"
