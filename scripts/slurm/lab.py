#!/usr/bin/env python3
"""A real multi-node Slurm cluster on one machine: try the cluster scripts, then break nodes.

    python3 scripts/slurm/lab.py up --nodes 3 [--favoured n3]  # as root; prints its folder
    export DEADPOOL_LAB_DIR=/tmp/dplab-XXXXXXXX          # (or --state DIR on every command)
    eval "$(python3 scripts/slurm/lab.py env)"           # SLURM_CONF for sbatch, squeue, ...
    python3 scripts/slurm/lab.py status
    python3 scripts/slurm/lab.py crash n2                # the whole node dies at once
    python3 scripts/slurm/lab.py freeze n2 | thaw n2     # SIGSTOP / SIGCONT all its processes
    python3 scripts/slurm/lab.py cut n2 | uncut n2       # off / back on the network
    python3 scripts/slurm/lab.py revive n2 [--favoured]  # boot a crashed node again
    python3 scripts/slurm/lab.py down                    # everything the lab created, by PID

Each node nI is a `slurmd -N nI` in its own network, PID, UTS and mount namespace: a veth
pair joins it to a bridge on this machine, where `slurmctld` and `munged` run; process 1 of
its PID namespace is a shell (it names the node, mounts the lab's hosts file over /etc/hosts
and reaps orphans), so killing that one process kills the whole node. Every daemon, file and
name the lab creates is recorded in its state folder; `down` removes exactly those, never
anything found by name, and then the folder.

The lab runs as root and trusts nothing another user could have put in its way: its state
folder is private (`up` makes a fresh one with mkdtemp, mode 0700, or creates the `--state`
folder it is given; a folder that exists is used only when root owns it and no group or other
user may write to it, and never through a symbolic link), state.json is read only from there
(a regular file root owns), every process it signals must still carry the lab's secret in its
environment (a PID in the state that is not the lab's own is never signalled), each `up`
writes a fresh munge key, and the script its nodes run is written there too. The folder is
root's alone: run Slurm's commands against the lab as root as well.

The nodes accept the site options of scripts/slurm/*.sbatch unchanged: partitions debug
(default), gh and gh-dev (Vista), `--gpus-per-node` up to --gpus-per-node fake GPUs per node,
`--constraint=gpu`, any `-A` and `--qos` (accounting is off).

Containers on the nodes: `install_packages(CONTAINER_PACKAGES, CONTAINER_PROGRAMS)` installs
podman 4.3, and `Lab.podman_env()` gives it storage and state of the lab's own, in the state
folder (tests/cluster/podman_python.sh runs a process in a container with it).

Standard library only (the tests import it); Linux, root, Debian's Slurm 22.05 packages.
Errors are one line `lab: error: ...` and exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import os
import resource
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
PROGRAMS = ["slurmctld", "slurmd", "munged", "sbatch", "scontrol", "sinfo", "squeue", "srun"]
CONTAINER_PACKAGES = ["podman", "runc", "catatonit"]
"""A container runtime for the lab's nodes (`install_packages(CONTAINER_PACKAGES, ...)`): Debian's
podman 4.3, with runc (crun refuses a machine whose cgroup v2 hierarchy holds a controller while
v1 is mounted: "cgroups in hybrid mode not supported") and catatonit (`podman run --init`)."""
CONTAINER_PROGRAMS = ["podman", "runc", "catatonit"]
STATE_ENV = "DEADPOOL_LAB_DIR"
"""The environment variable naming the lab's state folder when `--state` is not given."""
TOKEN_ENV = "DEADPOOL_LAB_TOKEN"
"""Set, to the lab's secret, in the environment of every process the lab starts."""
SUBNETS = ipaddress.ip_network("10.213.0.0/16")  # the lab takes the first free /24 in it
FAVOURED_WEIGHT = 16
"""A favoured node's CPU weight, in multiples of the default (`Lab.revive`)."""

NODE_SCRIPT = """#!/bin/bash
# Process 1 of lab node $1's PID namespace (written by lab.py): name the node, give it the
# lab's hosts file, start its slurmd, and stay alive reaping orphans (slurmstepd, tasks).
node=$1 conf=$2 hosts=$3 log=$4
hostname "$node"
mount --bind "$hosts" /etc/hosts
slurmd -D -f "$conf" -N "$node" >>"$log" 2>&1 &
while :; do
    sleep 3600 &
    wait $!
done
"""


class LabError(Exception):
    """Bad input or a failed step: one line for the user."""


class LabUnavailable(LabError):
    """This machine cannot host the lab (not root, no namespaces)."""


# ---------------------------------------------------------------------- processes
def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, ..., starttime at index 19)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return data[data.rfind(")") + 2 :].split()


def _record(pid: int) -> dict[str, int]:
    """A process as the lab records it: its PID and start time (so a reused PID never counts)."""
    fields = _stat(pid)
    if fields is None:
        raise LabError(f"process {pid} vanished right after it started")
    return {"pid": pid, "start": int(fields[19])}


def _alive(rec: dict[str, int] | None) -> bool:
    if not rec:
        return False
    fields = _stat(rec["pid"])
    return fields is not None and int(fields[19]) == rec["start"] and fields[0] != "Z"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _remove_cgroup(folder: Path) -> None:
    """Remove an empty cgroup of the lab's (its processes may take a moment to leave it)."""
    deadline = time.monotonic() + 5
    while folder.exists():
        try:
            folder.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                return  # still in use: left, named in the state no more
            time.sleep(0.05)


def _pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def _state(pid: int) -> str | None:
    """A process's state letter (R running, S sleeping, T stopped, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _ours(rec: dict[str, int] | None, token: str | None) -> bool:
    """A recorded process that is still that process (PID and start time) and one the lab
    started: its environment carries the lab's secret `token`."""
    if not rec or not token or not _alive(rec):
        return False
    try:
        environ = Path(f"/proc/{rec['pid']}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{TOKEN_ENV}={token}".encode() in environ


def _signal(rec: dict[str, int] | None, sig: int, token: str | None) -> bool:
    """Send `sig` to a recorded process if it is still that process and the lab's own."""
    if not _ours(rec, token):
        return False
    assert rec is not None  # _ours: a record
    try:
        os.kill(rec["pid"], sig)
    except ProcessLookupError:
        return False
    return True


def _stop_recorded(rec: dict[str, int] | None, token: str | None, grace: float = 5.0) -> None:
    """SIGTERM a recorded daemon of the lab's, SIGKILL it after `grace` seconds."""
    if not _signal(rec, signal.SIGTERM, token):
        return
    deadline = time.monotonic() + grace
    while _alive(rec) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal(rec, signal.SIGKILL, token)


# ---------------------------------------------------------------------- the private folder
def _check_private(path: Path, what: str, *, folder: bool) -> None:
    """Refuse `path` unless it is a real folder (or regular file), not a symbolic link, that
    this user owns and no group or other user may write to."""
    info = os.lstat(path)
    kind = stat.S_ISDIR(info.st_mode) if folder else stat.S_ISREG(info.st_mode)
    if not kind:
        expected = "a folder" if folder else "a regular file"
        raise LabError(f"{what} {path} is not {expected} (a symbolic link?): refused")
    if info.st_uid != os.geteuid():
        raise LabError(f"{what} {path} belongs to uid {info.st_uid}, not to this user: refused")
    if info.st_mode & 0o022:
        raise LabError(
            f"{what} {path} is writable by group or others (mode {info.st_mode & 0o777:o}): "
            "refused"
        )


def _write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Create `path` afresh (whatever was there is removed first, a link never followed) with
    `data`, atomically: a new file under a unique name, renamed over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _run(cmd: Sequence[str], *, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True, check=False, **kw)
    if check and done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise LabError(f"`{' '.join(cmd)}` failed: {why[-1] if why else done.returncode}")
    return done


# ---------------------------------------------------------------------- host checks
def unavailable() -> str | None:
    """Why this machine cannot run the lab, or None."""
    if sys.platform != "linux":
        return "the lab needs Linux (network, PID, UTS and mount namespaces)"
    if os.geteuid() != 0:
        return "the lab must run as root (it creates network namespaces and Slurm daemons)"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (install iproute2 / util-linux)"
    probe = subprocess.run(
        ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--uts", "true"],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()
        return (
            "no network/PID namespace support here (unshare: "
            + (why[-1] if why else f"exit {probe.returncode}")
            + ")"
        )
    return None


def missing_programs(programs: Sequence[str] = PROGRAMS) -> list[str]:
    return [p for p in programs if shutil.which(p) is None]


def install_packages(
    packages: Sequence[str] = PACKAGES, programs: Sequence[str] = PROGRAMS
) -> None:
    """apt-get install Debian's Slurm and munge packages (or `packages`, which provide
    `programs`: CONTAINER_PACKAGES) when a program is missing; no service is started by it."""
    if not missing_programs(programs):
        return
    if shutil.which("apt-get") is None:
        raise LabError(
            f"missing {', '.join(missing_programs(programs))} and no apt-get: install "
            f"{' '.join(packages)} by hand"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")  # keeps the packages from starting system daemons
    created = not policy.exists()
    if created:
        policy.write_text("#!/bin/sh\n# written by deadpool's lab.py during apt-get\nexit 101\n")
        policy.chmod(0o755)
    try:
        _run(["apt-get", "update", "-qq"], env=env, timeout=600)
        _run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
            env=env,
            timeout=1200,
        )
    finally:
        if created:
            policy.unlink()
    if missing_programs(programs):
        missing = ", ".join(missing_programs(programs))
        raise LabError(f"still missing after apt-get install: {missing}")


# ---------------------------------------------------------------------- the lab
class Lab:
    """One lab, described by its private state folder (module docstring)."""

    def __init__(self, state_dir: str | os.PathLike) -> None:
        """The lab in `state_dir`: a private folder of this user's (refused otherwise), or one
        that does not exist yet (`up` creates it)."""
        self.dir = Path(state_dir).absolute()
        self.state_file = self.dir / "state.json"
        self.tag = hashlib.sha256(str(self.dir).encode()).hexdigest()[:4]
        self.state: dict[str, Any] = {}
        if os.path.lexists(self.dir):
            _check_private(self.dir, "the lab's state folder", folder=True)
            if os.path.lexists(self.state_file):
                _check_private(self.state_file, "the lab's state file", folder=False)
                self.state = json.loads(self.state_file.read_text())

    @classmethod
    def fresh(cls, parent: str | os.PathLike | None = None) -> Lab:
        """A lab in a new private folder (mkdtemp: mode 0700) under `parent` (default: the
        system's temporary folder)."""
        return cls(tempfile.mkdtemp(prefix="dplab-", dir=parent))

    # -------------------------------------------------------------- state
    def _save(self) -> None:
        _write_private(self.state_file, json.dumps(self.state, indent=1).encode())

    @property
    def token(self) -> str | None:
        """The secret every process of this lab carries in its environment (`_ours`)."""
        return self.state.get("token")

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def env(self) -> dict[str, str]:
        """What Slurm's commands need to reach this lab's controller (and lab.py its folder)."""
        return {"SLURM_CONF": str(self.conf), STATE_ENV: str(self.dir)}

    def podman_env(self) -> dict[str, str]:
        """What podman needs to run containers on this lab's nodes, all its state in the lab's
        folder (removed with it by `down`): its settings (CONTAINERS_CONF) and storage
        (CONTAINERS_STORAGE_CONF), file locks, runc's state (a shim adds runc's --root) - none
        in this machine's /var/lib/containers, /run or /dev/shm. Written on the first call."""
        d = self.dir / "podman"
        if not d.exists():
            d.mkdir(mode=0o700)
            _write_private(d / "runc", f'#!/bin/sh\nexec runc --root {d}/runc-state "$@"\n'.encode(),
                           0o700)  # fmt: skip
            # Limits podman can set: it asks for nofile 1048576 by default, refused without
            # CAP_SYS_RESOURCE (a sandbox's root), and lowers its own nproc to 32768 first.
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
            nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
            conf = [
                "# Written by scripts/slurm/lab.py: podman on the lab's nodes (Lab.podman_env).",
                "[containers]",
                f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]',
                "[engine]",
                'cgroup_manager = "cgroupfs"',
                'events_logger = "file"',
                'lock_type = "file"',
                f'tmp_dir = "{d}/tmp"',
                'runtime = "lab"',
                "[engine.runtimes]",
                f'lab = ["{d}/runc"]',
            ]
            _write_private(d / "containers.conf", ("\n".join(conf) + "\n").encode())
            storage = ["[storage]", 'driver = "overlay"', f'graphroot = "{d}/root"',
                       f'runroot = "{d}/run"']  # fmt: skip
            _write_private(d / "storage.conf", ("\n".join(storage) + "\n").encode())
        return {
            "CONTAINERS_CONF": str(d / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(d / "storage.conf"),
        }

    def nodes(self) -> list[str]:
        return list(self.state.get("nodes", {}))

    def _node(self, name: str) -> dict[str, Any]:
        nodes = self.state.get("nodes", {})
        if name not in nodes:
            known = ", ".join(nodes) or "none: run `up` first"
            raise LabError(f"no lab node {name!r} (nodes: {known})")
        return nodes[name]

    def slurm(self, *cmd: str, check: bool = True, timeout: float = 60) -> str:
        """Run a Slurm command against this lab; its stdout."""
        env = {**os.environ, **self.env()}
        return _run(cmd, check=check, env=env, timeout=timeout).stdout

    # -------------------------------------------------------------- up
    def up(
        self,
        nodes: int,
        gpus_per_node: int = 4,
        cpus_per_node: int = 128,
        favoured: Sequence[str] = (),
    ) -> None:
        """Install Slurm if missing, then bring up the controller and `nodes` nodes; those named
        in `favoured` get the CPUs first (`revive`)."""
        if nodes < 1 or nodes > 200:
            raise LabError(f"--nodes: between 1 and 200, got {nodes}")
        if gpus_per_node < 0 or gpus_per_node > 64:
            raise LabError(f"--gpus-per-node: between 0 and 64, got {gpus_per_node}")
        if cpus_per_node < 1:
            raise LabError(f"--cpus-per-node: at least 1, got {cpus_per_node}")
        unknown = sorted(set(favoured) - {f"n{i}" for i in range(1, nodes + 1)})
        if unknown:
            raise LabError(f"--favoured: no node {unknown[0]} among n1..n{nodes}")
        reason = unavailable()
        if reason:
            raise LabUnavailable(reason)
        if self.state.get("nodes") or self.state.get("procs"):
            raise LabError(f"a lab is already up in {self.dir}: run `down` first")
        socket_path = self.dir / "munge" / "munge.socket"
        if len(str(socket_path)) > 100:
            raise LabError(
                f"--state {self.dir}: too long for a unix socket path; pick a shorter one"
            )
        install_packages()
        try:
            self.dir.mkdir(mode=0o700)  # never one made meanwhile by someone else
        except FileExistsError:
            _check_private(self.dir, "the lab's state folder", folder=True)
        for sub in ("ctld", "spool", "run"):  # an earlier lab's jobs must not come back
            shutil.rmtree(self.dir / sub, ignore_errors=True)
        for sub in ("munge", "ctld", "spool", "log", "run", "dev"):
            (self.dir / sub).mkdir(mode=0o700, exist_ok=True)
        self.state = {"tag": self.tag, "token": secrets.token_hex(16), "procs": {}, "nodes": {},
                      "links": [], "netns": [], "cgroups": []}  # fmt: skip
        self._save()
        try:
            self._network(nodes)
            self._write_config(nodes, gpus_per_node, cpus_per_node)
            self._start_munge()
            self._start_controller()
            for name in self.nodes():
                self._start_node(name, name in favoured)
            self.wait_idle(self.nodes(), timeout=60)
        except BaseException:
            self.down()
            raise

    def _network(self, nodes: int) -> None:
        used = _run(["ip", "-4", "route", "show", "table", "all"]).stdout
        used += _run(["ip", "-4", "addr"]).stdout
        for net in SUBNETS.subnets(new_prefix=24):
            prefix = str(net.network_address).rsplit(".", 1)[0] + "."
            if prefix not in used:
                break
        else:
            raise LabError(f"no free /24 left in {SUBNETS} for the lab's bridge")
        bridge = f"dplab{self.tag}"
        self.state.update(subnet=str(net), bridge=bridge, host_addr=prefix + "1")
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        self.state["links"].append(bridge)
        self._save()
        _run(["ip", "addr", "add", f"{prefix}1/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        for i in range(1, nodes + 1):
            name, netns, veth = f"n{i}", f"dplab{self.tag}-n{i}", f"dpl{self.tag}v{i}"
            _run(["ip", "netns", "add", netns])
            self.state["netns"].append(netns)
            self._save()
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"])
            self.state["links"].append(veth)
            self._save()
            _run(["ip", "link", "set", f"{veth}p", "netns", netns])
            _run(["ip", "-n", netns, "link", "set", f"{veth}p", "name", "eth0"])
            _run(["ip", "-n", netns, "addr", "add", f"{prefix}{10 + i}/24", "dev", "eth0"])
            _run(["ip", "-n", netns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", netns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", veth, "master", bridge])
            _run(["ip", "link", "set", veth, "up"])
            self.state["nodes"][name] = {"netns": netns, "veth": veth, "addr": f"{prefix}{10 + i}"}
            self._save()

    def _free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def _write_config(self, nodes: int, gpus: int, cpus: int) -> None:
        d, host = self.dir, socket.gethostname().split(".")[0]
        self.state.update(controller=host, ctld_port=self._free_port(), gpus_per_node=gpus)
        self._save()
        lines = [
            "# Written by scripts/slurm/lab.py: a lab cluster on one machine; see its docstring.",
            "ClusterName=deadpoollab",
            f"SlurmctldHost={host}({self.state['host_addr']})",
            f"SlurmctldPort={self.state['ctld_port']}",
            "SlurmdPort=6818",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d}/munge/munge.socket",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SlurmdTimeout=10",
            "SlurmctldTimeout=10",
            "KillWait=5",
            "MinJobAge=3600",
            f"StateSaveLocation={d}/ctld",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
        ]
        node_opts = f"CPUs={cpus} Feature=gpu State=UNKNOWN"
        if gpus:
            lines.append("GresTypes=gpu")
            node_opts += f" Gres=gpu:{gpus}"
            for g in range(gpus):  # fake devices (like /dev/null): Slurm checks they exist
                dev = d / "dev" / f"gpu{g}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            last = f"gpu[0-{gpus - 1}]" if gpus > 1 else "gpu0"
            _write_private(
                d / "gres.conf", f"NodeName=n[1-{nodes}] Name=gpu File={d}/dev/{last}\n".encode()
            )
        for name, node in self.state["nodes"].items():
            lines.append(f"NodeName={name} NodeHostname={name} NodeAddr={node['addr']} {node_opts}")
        for partition, default in (("debug", "YES"), ("gh", "NO"), ("gh-dev", "NO")):
            lines.append(
                f"PartitionName={partition} Nodes=ALL Default={default} MaxTime=INFINITE State=UP"
            )
        _write_private(self.conf, ("\n".join(lines) + "\n").encode(), 0o644)
        hosts = ["127.0.0.1 localhost", f"{self.state['host_addr']} {host}"]
        hosts += [f"{n['addr']} {name}" for name, n in self.state["nodes"].items()]
        _write_private(d / "hosts", ("\n".join(hosts) + "\n").encode(), 0o644)
        _write_private(d / "node.sh", NODE_SCRIPT.encode(), 0o700)

    def _daemon(self, name: str, cmd: list[str]) -> None:
        with open(self.dir / "log" / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self._child_env(),
            )
        self.state["procs"][name] = _record(proc.pid)
        self._save()

    def _child_env(self) -> dict[str, str]:
        """The environment of a process the lab starts: Slurm's, and the lab's secret."""
        assert self.token, "no lab token: `up` sets it first"
        return {**os.environ, **self.env(), TOKEN_ENV: self.token}

    def _start_munge(self) -> None:
        m = self.dir / "munge"
        key = m / "munge.key"
        _write_private(key, secrets.token_bytes(128), 0o400)  # fresh for every lab
        (m / "munge.socket").unlink(missing_ok=True)  # an earlier lab's, if any
        self._daemon(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={m}/munge.socket",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
        )
        self._wait(lambda: (m / "munge.socket").exists(), 10, "munged did not create its socket")

    def _start_controller(self) -> None:
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._wait(
            lambda: "UP" in self.slurm("scontrol", "ping", check=False, timeout=10),
            30,
            f"slurmctld did not come up (see {self.dir}/log/slurmctld.log)",
        )

    def _start_node(self, name: str, favoured: bool = False) -> None:
        node = self._node(name)
        enter = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', self._favour(name)] if favoured else []
        cmd = [
            *enter,  # it execs: proc.pid stays the launcher, process 1's parent
            "nsenter",
            f"--net=/run/netns/{node['netns']}",
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--uts",
            "--kill-child",
            "/bin/bash",
            str(self.dir / "node.sh"),
            name,
            str(self.conf),
            str(self.dir / "hosts"),
            str(self.dir / "log" / f"slurmd-{name}.out"),
        ]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=self._child_env(),
        )
        node["launcher"] = _record(proc.pid)
        self._save()
        init = self._wait(
            lambda: next((p for p in _pids() if (_stat(p) or ["", ""])[1] == str(proc.pid)), None),
            10,
            f"node {name}: its namespace did not start",
        )
        node["init"] = _record(init)
        node["pid_ns"] = _pid_ns(init)
        node.pop("frozen", None)
        self._save()

    @staticmethod
    def _wait(probe: Any, timeout: float, why: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise LabError(why)
            time.sleep(0.1)

    def node_states(self) -> dict[str, str]:
        """Slurm's state of each node (idle, alloc, down*, ...)."""
        out = self.slurm("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, names: list[str], timeout: float) -> None:
        self._wait(
            lambda: all(self.node_states().get(n) == "idle" for n in names),
            timeout,
            f"nodes {names} not idle after {timeout:.0f}s: {self.node_states()} "
            f"(see {self.dir}/log/slurmd-*.log)",
        )

    # -------------------------------------------------------------- breaking nodes
    def node_pids(self, name: str) -> list[int]:
        """Every process of node `name` (the PID namespace of its process 1, the lab's own),
        by host PID."""
        init = self._node(name).get("init")
        if not _ours(init, self.token):
            return []
        assert init is not None
        pid_ns = _pid_ns(init["pid"])
        return [p for p in _pids() if pid_ns is not None and _pid_ns(p) == pid_ns]

    def crash(self, name: str) -> None:
        """SIGKILL process 1 of the node's PID namespace: every process of the node dies."""
        node = self._node(name)
        if not _signal(node.get("init"), signal.SIGKILL, self.token):
            raise LabError(f"node {name} is not running")
        self._wait(lambda: not self.node_pids(name), 10, f"node {name}: processes outlived it")

    def freeze(self, name: str) -> int:
        """SIGSTOP every process of the node (a hung node); how many."""
        if not self.node_pids(name):
            raise LabError(f"node {name} is not running")
        stopped: set[int] = set()
        while True:  # again until no new process appeared meanwhile
            fresh = [p for p in self.node_pids(name) if p not in stopped]
            if not fresh:
                break
            for pid in fresh:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
                stopped.add(pid)
            # A signal is delivered when its process next runs: wait until each one has
            # stopped (then a fork it was in has returned, and the next listing shows the child).
            self._wait(
                lambda pids=fresh: all(_state(p) in (None, "T", "t", "Z", "X") for p in pids),
                10,
                f"node {name}: processes still running 10 s after SIGSTOP",
            )
        self._node(name)["frozen"] = True
        self._save()
        return len(stopped)

    def thaw(self, name: str) -> int:
        """SIGCONT every process of the node; how many."""
        pids = self.node_pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self._node(name).pop("frozen", None)
        self._save()
        return len(pids)

    def cut(self, name: str, *, up: bool = False) -> None:
        """Take the node off the network (its host-side veth down), or back on."""
        node = self._node(name)
        _run(["ip", "link", "set", node["veth"], "up" if up else "down"])
        if up:
            node.pop("cut", None)
        else:
            node["cut"] = True
        self._save()

    def revive(self, name: str, favoured: bool = False) -> None:
        """Boot a crashed node again; Slurm returns it to service when its slurmd registers.

        `favoured`: every process of the node gets this machine's CPUs before the other nodes'
        (`_favour`), as a machine of its own would have its own CPUs, where all the nodes share
        a few cores."""
        if self.node_pids(name):
            raise LabError(f"node {name} is running: crash it first")
        self._start_node(name, favoured)

    def _favour(self, name: str) -> str:
        """A CPU cgroup of the lab's own for node `name`, with FAVOURED_WEIGHT times the
        default weight (a node's processes inherit it; Slurm's tasks too: the lab's TaskPlugin
        leaves them where slurmd is); its `cgroup.procs` file. Niceness would not do: under
        autogroup scheduling it orders processes only within their session, and a node's span
        several (a node revived at nice -10 joined a busy job no sooner)."""
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        if (v1 / "cgroup.procs").exists():  # cgroup v1's cpu hierarchy
            folder, knob, weight = v1 / f"dplab{self.tag}-{name}", "cpu.shares", 1024
        elif "cpu" in _read(v2 / "cgroup.controllers").split():
            if "cpu" not in _read(v2 / "cgroup.subtree_control").split():
                # the root's controller, machine-wide: left enabled by `down` (untested here,
                # a cgroup v1 machine)
                (v2 / "cgroup.subtree_control").write_text("+cpu")
            folder, knob, weight = v2 / f"dplab{self.tag}-{name}", "cpu.weight", 100
        else:
            raise LabError("a favoured node needs a cgroup CPU controller; this machine has none")
        folder.mkdir(exist_ok=True)
        if str(folder) not in self.state.setdefault("cgroups", []):
            self.state["cgroups"].append(str(folder))
            self._save()
        (folder / knob).write_text(str(FAVOURED_WEIGHT * weight))
        return str(folder / "cgroup.procs")

    def _remove_container_cgroups(self) -> None:
        """The cgroups of the containers podman ran on this lab's nodes (`podman_env`): podman
        removes a container's own when it ends, but not when its node crashed with it."""
        listed = self.dir / "podman" / "root" / "overlay-containers" / "containers.json"
        try:
            ids = [c["id"] for c in json.loads(listed.read_text())]
        except (OSError, ValueError, KeyError, TypeError):
            return
        for cid in ids:
            for folder in Path("/sys/fs/cgroup").glob(f"*/libpod_parent/libpod-{cid}"):
                try:
                    folder.rmdir()  # only once empty: every process of it died with its node
                except OSError:
                    pass

    # -------------------------------------------------------------- status, down
    def status(self) -> str:
        if not self.state.get("procs"):
            return f"no lab is up in {self.dir}"
        lines = [f"lab {self.dir}: bridge {self.state.get('bridge')} {self.state.get('subnet')}"]
        for name, rec in self.state["procs"].items():
            lines.append(f"  {name:10s} pid {rec['pid']:7d} {'up' if _alive(rec) else 'DEAD'}")
        slurm = self.node_states() if _alive(self.state["procs"].get("slurmctld")) else {}
        for name, node in self.state["nodes"].items():
            pids = self.node_pids(name)
            what = "crashed" if not pids else f"{len(pids)} processes"
            flags = [f for f in ("frozen", "cut") if node.get(f)]
            lines.append(
                f"  {name:10s} {node['addr']:15s} {what}{' ' + ' '.join(flags) if flags else ''}"
                f"; slurm: {slurm.get(name, '?')}"
            )
        return "\n".join(lines)

    def down(self) -> None:
        """Stop and remove everything this lab recorded, then its folder; safe to repeat, and
        after a failed up. Only the lab's own processes are signalled (`_ours`)."""
        nodes, token = self.state.get("nodes", {}), self.token
        for node in nodes.values():
            _signal(node.get("init"), signal.SIGKILL, token)  # the whole node with it
            _signal(node.get("launcher"), signal.SIGKILL, token)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            _ours(n.get("init"), token) or _ours(n.get("launcher"), token) for n in nodes.values()
        ):
            time.sleep(0.05)
        for name in ("slurmctld", "munged"):
            _stop_recorded(self.state.get("procs", {}).get(name), token)
        for link in reversed(self.state.get("links", [])):
            _run(["ip", "link", "del", link], check=False)
        for netns in self.state.get("netns", []):
            _run(["ip", "netns", "del", netns], check=False)
        self._remove_container_cgroups()
        for folder in self.state.get("cgroups", []):  # empty: their processes are gone
            _remove_cgroup(Path(folder))
        self.state = {}
        if os.path.lexists(self.dir):  # checked private when this object was made
            shutil.rmtree(self.dir)


# ---------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lab.py", description=__doc__.splitlines()[0], epilog="See the module docstring."
    )
    parser.add_argument(
        "--state",
        default=os.environ.get(STATE_ENV),
        help=f"the lab's private state folder (default ${STATE_ENV}; `up` without either makes "
        "a fresh one and prints it)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="install Slurm if missing; start a controller and N nodes")
    up.add_argument("--nodes", type=int, required=True)
    up.add_argument("--gpus-per-node", type=int, default=4, help="fake GPUs (gres) per node")
    up.add_argument("--cpus-per-node", type=int, default=128, help="CPUs Slurm believes")
    up.add_argument(
        "--favoured", default="", help="nodes whose processes get the CPUs first (n2,n4)"
    )
    sub.add_parser("env", help="print `export SLURM_CONF=...` for this lab")
    sub.add_parser("status", help="daemons, nodes and Slurm's view of them")
    for name, text in (
        ("crash", "SIGKILL the node's PID-namespace process 1 (every process of it dies)"),
        ("freeze", "SIGSTOP every process of the node"),
        ("thaw", "SIGCONT every process of the node"),
        ("cut", "take the node off the network"),
        ("uncut", "put the node back on the network"),
        ("revive", "boot a crashed node again"),
    ):
        sub.add_parser(name, help=text).add_argument("node", help="n1, n2, ...")
    sub.choices["revive"].add_argument(
        "--favoured", action="store_true", help="its processes get the CPUs before other nodes'"
    )
    sub.add_parser("down", help="stop and remove everything the lab created")
    args = parser.parse_args(argv)
    try:
        if os.geteuid() != 0:
            raise LabUnavailable(
                "the lab must run as root (it creates network namespaces and Slurm daemons)"
            )
        if args.state is None:
            if args.command != "up":
                raise LabError(f"which lab? give --state DIR (`up` printed it) or set {STATE_ENV}")
            lab = Lab.fresh()
        else:
            lab = Lab(args.state)
        if args.command == "up":
            favoured = [n for n in args.favoured.split(",") if n]
            try:
                lab.up(args.nodes, args.gpus_per_node, args.cpus_per_node, favoured)
            except LabError:
                if args.state is None:  # the folder made for it: nothing is left behind
                    lab.down()
                raise
            print(lab.status())
            print(f'next: export {STATE_ENV}={lab.dir}; eval "$(python3 {sys.argv[0]} env)"')
        elif args.command == "env":
            for key, value in lab.env().items():
                print(f"export {key}={value}")
        elif args.command == "status":
            print(lab.status())
        elif args.command == "down":
            lab.down()
        elif args.command in ("cut", "uncut"):
            lab.cut(args.node, up=args.command == "uncut")
        elif args.command == "revive":
            lab.revive(args.node, args.favoured)
        else:
            result = getattr(lab, args.command)(args.node)
            if isinstance(result, int):
                print(f"{args.command}: {result} processes of {args.node}")
    except (LabError, OSError) as exc:
        print(f"lab: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
