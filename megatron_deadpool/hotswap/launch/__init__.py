"""Starting a job's processes and keeping them: the fork server and warm start, the local and
srun jobs, node agents and their local form, the supervision loop that ticks the coordinator,
and dropping silent connections. Imported only by the commands, the jobs' launchers and the
benchmarks that launch."""
