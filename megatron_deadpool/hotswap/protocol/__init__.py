"""The job's store protocol, shared by every role: every key (`membership`), the typed
messages and their codec, the seal every value carries, bounded connections, the in-memory
store the unit tests run on, waking on store events and the retention of keys."""
