#!/bin/sh
# podman_python.sh ARGS...: python ARGS in a podman container - the PYTHON wrapper of
# docs/how-to/containers.md ("podman, podman-hpc") as the Slurm lab's tests run it
# (tests/cluster/test_slurm_lab.py). No registry is reachable there, so the image is this
# machine's own root, read-only (--rootfs /:O, an overlay whose writes go with the container);
# the container still has its own mount and PID namespaces, podman's environment handling, its
# signals, limits and cgroup.
#
#   CONTAINER_PYTHON  the Python inside the container (the image's)
#   CONTAINER_MOUNTS  folders mounted at the same path, space separated: the job's folder
#                     (logs, job.token, the config) - a write anywhere else is lost
#   CONTAINERS_CONF, CONTAINERS_STORAGE_CONF  podman's settings and storage (the lab's own:
#                     scripts/slurm/lab.py's Lab.podman_env)
#
# Why each option (podman 4.3.1 on this project's machine, without it):
#   --env-host  podman passes none of the caller's environment (RANK was empty inside); DeadPool's
#               processes need the launcher's (RANK, MASTER_ADDR, SLURM_*, DEADPOOL_JOB_TOKEN -
#               which must stay off command lines: never -e NAME=VALUE for it)
#   --init      python is otherwise process 1 of the container's PID namespace, which ignores
#               every signal it has no handler for: the SIGTERM podman passes on from Slurm
#               (scancel, the time limit) left it running
#   --net host, --ipc host  the node's network (the coordinator's port, torch.distributed,
#               the node's hostname) and its /dev/shm (the snapshots a node's processes keep;
#               without --ipc host the container had a /dev/shm of its own, 64 MB)
#   -w "$PWD"   the task's working directory (the submit folder)
#   --rm        nothing of the container stays once it ends
#   exec        podman's exit status is python's (128 + N when signal N ended it), which the
#               launcher and deadpool_coordinator.sh read
set -eu
: "${CONTAINER_PYTHON:?the Python inside the container}"
# Already inside (a node agent starting its node's workers with this same PYTHON): run Python
# there, in the agent's container.
if [ "${DEADPOOL_IN_CONTAINER:-}" = 1 ]; then
    exec "$CONTAINER_PYTHON" "$@"
fi
set -- --rootfs /:O "$CONTAINER_PYTHON" "$@"
for dir in ${CONTAINER_MOUNTS:-}; do
    set -- -v "$dir:$dir" "$@"
done
DEADPOOL_IN_CONTAINER=1 exec podman run --rm --init --env-host --net host --ipc host \
    -w "$PWD" "$@"
