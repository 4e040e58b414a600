"""The in-memory checkpoint: a rank's state packed and checksummed (`snapshot`, `pack`), sent
to its holders every iteration (`replicator`, its buffers in `slots`, host replicas checked on
a worker thread by `verifier`, the round's verdict posted ahead by `verdict`), where the
holders sit (`placement`, pure), and the snapshot sets written to disk when memory cannot
recover (`snapshot_set`, `save_dir`)."""
