"""The in-memory checkpoint: a rank's state packed and checksummed (`snapshot`, `pack`), sent
to its holders every iteration (`replicator`), where the holders sit (`placement`, pure), and
the snapshot sets written to disk when memory cannot recover (`snapshot_set`, `save_dir`)."""
