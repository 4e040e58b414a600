"""The hot-swap protocol, for any job: the store's keys (`membership`), the coordinator, the
restore plan (pure), group release and rebinding, the recovery steps and the driver of a
process's life cycle. Knows no concrete job: the embedded job and Megatron-LM plug in."""
