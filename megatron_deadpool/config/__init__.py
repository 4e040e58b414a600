"""What a job is told: `DeadpoolConfig` (every `--deadpool-*` flag), the job schema, cluster
files, fault specs and flag generation. Pure: no torch, no Megatron, no communication."""
