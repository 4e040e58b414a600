"""The job's secret, and the MAC that every value DeadPool puts in its store carries.

Whoever reaches the store's TCP port can read and write every key: torch's `TCPStore` has no
access control. So the store never holds the secret, and every value DeadPool writes is
sealed: `JobSeal.seal` prefixes the payload with an HMAC-SHA256, keyed by the job's secret, of
the store key's name and the payload. The key names the generation wherever a value belongs to
one (`gen{g}/plan`, `gen{g}/decided`, `gen{g}/ready/{rank}`, ...), so a value copied from
another key or another generation fails as a forged or altered one does. `Membership` seals
what it writes and opens what it reads (`ForgedValue` when the MAC does not match): a reader
treats a rejected value as absent and reports it once; nothing DeadPool acts on is read any
other way.

A seal is bound to the job's run and to the store it is written for, not only to the key: its
HMAC key is derived from the secret, the job id (`DEADPOOL_JOB_ID`, which every process of the
run is given out of band: by its launcher, or by `deadpool_launch.sh` from Slurm's job id and
restart count) and the store's place in the job's `--deadpool-coordinator` list (0 the
primary's, i the standby at entry i). So a value copied from another store of the same run (the
primary's into a standby's), from another run that reuses the secret (a requeued Slurm job, a
token file kept between runs) or from an earlier run's store does not open either. Nothing of the
binding is read from a store: an outsider could copy that as well. A process that talks to
several of the job's stores (a worker failing over, a standby watching the primary, a node's
agent) opens each with that store's seal (`for_store`).

The secret never enters the store nor a command line: a launcher generates one per job
(`new_secret`) and gives it to its processes in the environment (`DEADPOOL_JOB_TOKEN`), or in
a file only its owner may read (`DEADPOOL_JOB_TOKEN_FILE`, mode 0600: the Slurm scripts');
`job_secret` reads it, the same way in every process (`--deadpool-job-token` still sets it,
but puts it on a command line where `ps` shows it).

What a MAC cannot cover (README, "Trust model"): counters (`add`: report counters, the
numbers of numbered lists, wake-ups), whose atomic increments cannot carry one (heartbeats are
sealed beat numbers, set, not counted); torch's own rendezvous keys of
the process groups (`gen{g}/...` of `Membership.process_group_store`) and the gloo/NCCL
traffic itself; and a client that deletes keys or floods the store.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from ...errors import ConfigError
from .codec import ProtocolError, read_text

SECRET_ENV = "DEADPOOL_JOB_TOKEN"
"""The environment variable that holds the job's secret."""

SECRET_FILE_ENV = "DEADPOOL_JOB_TOKEN_FILE"
"""The environment variable that names a file holding it (mode 0600, owner only)."""

JOB_ID_ENV = "DEADPOOL_JOB_ID"
"""The environment variable that holds the job's run id (`job_binding`)."""

JOB_ID_CHARS = 128
"""The longest run id."""

MAC_CHARS = 64
"""A sealed value's prefix: the HMAC-SHA256 in hex."""

BLOCK = 64
"""SHA-256's block size: HMAC pads its key to it."""


class ForgedValue(ProtocolError):
    """A store value without this job's MAC: forged, altered, or copied from another key."""


class JobSeal:
    """Seals and opens store values with the job's secret (never stored, never shown), for one
    run of the job (`job`) and one of its stores (`store`)."""

    def __init__(self, secret: str, job: str = "", store: int = 0) -> None:
        """`secret` empty: a process given none, which no job's store will accept (launchers
        and `deadpool coordinator` never run a job without one): it is refused as it connects
        (`Membership.check_token`), after its coordinator's address was checked. `job`: the
        run's id (`job_binding`; empty: none given, the secret alone tells runs apart);
        `store`: the store's entry in `--deadpool-coordinator` (0: the primary's, or the store
        a launcher hosts)."""
        # A key of its own, derived from the secret: the secret itself is never MAC material.
        self._bind(hashlib.sha256(b"deadpool store seal\0" + secret.encode()).digest(), job, store)

    def _bind(self, root: bytes, job: str, store: int) -> None:
        if store < 0:
            raise ValueError(f"JobSeal: store {store}: an entry of --deadpool-coordinator, >= 0")
        self._root = root
        self.job = job
        self.store = store
        # The MAC key of this run and store: HMAC of the binding under the secret's key.
        binding = json.dumps(["deadpool store binding", job, store]).encode()
        key = hmac.new(root, binding, hashlib.sha256).digest()
        # HMAC (RFC 2104) with its inner and outer hashes keyed once and copied for each MAC:
        # the same MAC as `hmac.new(key, message, sha256)` in a quarter of `hmac.digest`'s CPU
        # (which looks the digest up by name on every call): ~1 us for a survivor's report.
        block = key.ljust(BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def __repr__(self) -> str:
        return f"JobSeal(<secret>, job={self.job!r}, store={self.store})"

    def for_store(self, store: int) -> JobSeal:
        """The seal of the same job and run for the store at entry `store` of
        `--deadpool-coordinator` (a standby's: its own, so nothing copied between the job's
        stores opens)."""
        other = JobSeal.__new__(JobSeal)
        other._bind(self._root, self.job, store)
        return other

    def _mac(self, key: str, payload: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(key.encode() + b"\0" + payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest().encode()

    def seal(self, key: str, payload: str) -> str:
        """`payload` as stored under `key`: its MAC, then the payload."""
        return self._mac(key, payload.encode()).decode() + payload

    def verifies(self, key: str, raw: str | bytes) -> bool:
        """Whether `raw` carries this seal's MAC for `key`."""
        data = raw.encode() if isinstance(raw, str) else raw
        mac, payload = data[:MAC_CHARS], data[MAC_CHARS:]
        return len(data) >= MAC_CHARS and hmac.compare_digest(mac, self._mac(key, payload))

    def open(self, key: str, raw: str | bytes) -> bytes:
        """The payload `raw` carries, read from `key`; `ForgedValue` when its MAC is not this
        job's for this key, this run and this store."""
        data = raw.encode() if isinstance(raw, str) else raw
        if not self.verifies(key, data):
            shown = read_text(data)
            shown = shown if len(shown) <= 120 else shown[:120] + "..."
            raise ForgedValue(
                f"store key {key}: rejected {shown!r}: it does not carry this job's MAC for this "
                "key and store (forged, altered, or copied from another key, generation, store or "
                "run of the job)"
            )
        return data[MAC_CHARS:]


def job_binding(env: Mapping[str, str] = os.environ) -> str:
    """The job's run id every process of it is given out of band (`DEADPOOL_JOB_ID`); empty
    when none is (the secret alone then tells runs apart). `ConfigError` for an id that is not
    1-128 printable characters."""
    job = env.get(JOB_ID_ENV, "")
    if job and (len(job) > JOB_ID_CHARS or not job.isprintable()):
        shown = repr(job) if len(job) <= 40 else repr(job[:40]) + "..."
        raise ConfigError(
            f"{JOB_ID_ENV}: {shown} is not an id of 1-{JOB_ID_CHARS} printable characters; "
            "give every process of the job the id its launcher printed"
        )
    return job


def new_job_id() -> str:
    """A fresh run id, for a launcher whose environment gives none."""
    return "run-" + secrets.token_hex(8)


def new_secret() -> str:
    """A fresh secret for one job (256 bits)."""
    return secrets.token_hex(32)


def job_secret(configured: str | None = None) -> str | None:
    """The job's secret: `configured` (`--deadpool-job-token`), else `DEADPOOL_JOB_TOKEN`,
    else the file `DEADPOOL_JOB_TOKEN_FILE` names, which only its owner may read; None when
    none is given."""
    if configured:
        return configured
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    path = os.environ.get(SECRET_FILE_ENV)
    return read_secret_file(Path(path)) if path else None


def read_secret_file(path: Path) -> str:
    """The secret in `path`; `ConfigError` if the file is missing, empty, or readable or
    writable by anyone but its owner."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{SECRET_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{SECRET_FILE_ENV}: {path} is open to others (mode {stat.S_IMODE(mode):o}); "
            f"`chmod 600 {path}`"
        )
    if not text:
        raise ConfigError(f"{SECRET_FILE_ENV}: {path} is empty")
    return text


def write_secret_file(path: Path, secret: str) -> Path:
    """Write `secret` to a new file `path` that only its owner may read (0600 from creation)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return path
