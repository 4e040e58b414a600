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

The secret never enters the store nor a command line: a launcher generates one per job
(`new_secret`) and gives it to its processes in the environment (`DEADPOOL_JOB_TOKEN`), or in
a file only its owner may read (`DEADPOOL_JOB_TOKEN_FILE`, mode 0600: the Slurm scripts');
`job_secret` reads it, the same way in every process (`--deadpool-job-token` still sets it,
but puts it on a command line where `ps` shows it).

What a MAC cannot cover (README, "Trust model"): counters (`add`: heartbeats, report
counters, wake-ups), whose atomic increments cannot carry one; torch's own rendezvous keys of
the process groups (`gen{g}/...` of `Membership.process_group_store`) and the gloo/NCCL
traffic itself; and a client that deletes keys or floods the store.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from ...errors import ConfigError
from .codec import ProtocolError, read_text

SECRET_ENV = "DEADPOOL_JOB_TOKEN"
"""The environment variable that holds the job's secret."""

SECRET_FILE_ENV = "DEADPOOL_JOB_TOKEN_FILE"
"""The environment variable that names a file holding it (mode 0600, owner only)."""

MAC_CHARS = 64
"""A sealed value's prefix: the HMAC-SHA256 in hex."""

BLOCK = 64
"""SHA-256's block size: HMAC pads its key to it."""


class ForgedValue(ProtocolError):
    """A store value without this job's MAC: forged, altered, or copied from another key."""


class JobSeal:
    """Seals and opens store values with the job's secret (never stored, never shown)."""

    def __init__(self, secret: str) -> None:
        """`secret` empty: a process given none, which no job's store will accept (launchers
        and `deadpool coordinator` never run a job without one): it is refused as it connects
        (`Membership.check_token`), after its coordinator's address was checked."""
        # A key of its own, derived from the secret: the secret itself is never MAC material.
        key = hashlib.sha256(b"deadpool store seal\0" + secret.encode()).digest()
        # HMAC (RFC 2104) with its inner and outer hashes keyed once and copied for each MAC:
        # the same MAC as `hmac.new(key, message, sha256)` in a quarter of `hmac.digest`'s CPU
        # (which looks the digest up by name on every call): ~1 us for a survivor's report.
        block = key.ljust(BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def __repr__(self) -> str:
        return "JobSeal(<secret>)"

    def _mac(self, key: str, payload: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(key.encode() + b"\0" + payload)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest().encode()

    def seal(self, key: str, payload: str) -> str:
        """`payload` as stored under `key`: its MAC, then the payload."""
        return self._mac(key, payload.encode()).decode() + payload

    def open(self, key: str, raw: str | bytes) -> bytes:
        """The payload `raw` carries, read from `key`; `ForgedValue` when its MAC is not this
        job's for this key."""
        data = raw.encode() if isinstance(raw, str) else raw
        mac, payload = data[:MAC_CHARS], data[MAC_CHARS:]
        if len(data) < MAC_CHARS or not hmac.compare_digest(mac, self._mac(key, payload)):
            shown = read_text(data)
            shown = shown if len(shown) <= 120 else shown[:120] + "..."
            raise ForgedValue(
                f"store key {key}: rejected {shown!r}: it does not carry this job's MAC for this "
                "key (forged, altered, or copied from another key or generation)"
            )
        return payload


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
