#!/usr/bin/env bash
# deadpool_coordinator.sh: run one of a Slurm job's coordinators; when it ends the job, end the
# Slurm job too.
#
#   scripts/slurm/deadpool_coordinator.sh NAME deadpool coordinator ...
#
# Started by deadpool_launch.sh for the primary (on the batch host) and the standby (another
# node). The coordinator's output goes to $DEADPOOL_LOG_DIR/NAME.log, its exit status to
# $DEADPOOL_LOG_DIR/NAME.status. When it exits as the job's active coordinator - 0 every rank
# finished, 3 out of redundancy (the survivors save what they hold), 6 --max-wait, 9 the job's
# own error (a rank's exception before replication started, or a spare failing as the rank it
# replaced did; its log names it: fix the job, do not requeue it as it is) - this script
# says why in the job's log ($DEADPOOL_JOB_LOG, appended; else its standard output), gives the
# tasks DEADPOOL_END_GRACE seconds to end on their own, then cancels the job (scancel), so that
# no stopped or frozen task, nor a job whose batch host died, holds the nodes. Any other status
# (5: not the job's coordinator, a standby not needed or a primary a standby took over from; 4:
# a standby with no primary; a crash) ends nothing: a standby takes over, or the tasks give up
# after --deadpool-connect-timeout.
set -uo pipefail

name=${1:?usage: deadpool_coordinator.sh NAME COMMAND...}
shift
: "${DEADPOOL_LOG_DIR:?}"
: "${DEADPOOL_END_GRACE:=60}"

"$@" >>"$DEADPOOL_LOG_DIR/$name.log" 2>&1
rc=$?
echo "$rc" >"$DEADPOOL_LOG_DIR/$name.status"
case $rc in
0) why="every rank finished" ;;
3) why="out of redundancy: the survivors save what they hold" ;;
6) why="--max-wait reached" ;;
9) why="the job's own error (JOB ERROR in the log): fix the job" ;;
5) exit 0 ;; # not the job's coordinator: nothing went wrong
*) exit "$rc" ;;
esac
job=${SLURM_JOB_ID:?}
say() {
    local line
    line="deadpool_coordinator: $(date +%T) $*"
    if [ -n "${DEADPOOL_JOB_LOG:-}" ]; then echo "$line" >>"$DEADPOOL_JOB_LOG"; else echo "$line"; fi
}
say "$name on $(hostname) exited with status $rc ($why, see $DEADPOOL_LOG_DIR/$name.log):" \
    "the Slurm job $job ends within ${DEADPOOL_END_GRACE}s"
for ((waited = 0; waited < DEADPOOL_END_GRACE; waited++)); do
    # Ended on its own: squeue answers, and no longer lists it (a squeue that fails - a busy
    # or unreachable slurmctld - prints nothing too, and proves nothing).
    if state=$(squeue -h -j "$job" -o %T 2>/dev/null); then
        [ -n "$state" ] || exit "$rc"
    fi
    sleep 1
done
say "the job still runs ${DEADPOOL_END_GRACE}s after the coordinator exited (tasks stuck, or" \
    "its batch host gone): cancelling job $job"
scancel "$job"
exit "$rc"
