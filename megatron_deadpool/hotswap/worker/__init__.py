"""One training process's side of the protocol: the driver of its life cycle and the adapter
a job implements, the recovery steps, group repair and rebinding, the plan watch, a newcomer's
private world and claim, restoring weights, fault injection and the link that survives a lost
coordinator. Never imports the coordinator: it reads the coordinator's decisions from the
store."""
