"""`ClusterConfig`: what the planner and the Slurm scripts need to know about a site's nodes.

A cluster description is the optional `cluster:` section of a job config, or a file holding
only that section (`configs/clusters/*.yaml`, read with `load_cluster`). It records the node
hardware (GPUs, memories, links, peak throughput) that `deadpool plan` turns into memory,
traffic and recovery-time figures, and the site's Slurm defaults and environment that the
matching `scripts/slurm/<site>.sbatch` sets (a test keeps the two in sync).

Units: memory in GiB (2**30 bytes, as `nvidia-smi` and `free -g` count), bandwidth in GB/s
(10**9 bytes per second, as NIC and link data sheets give it), throughput in TFLOP/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .flags import from_mapping
from .numbers import check_number
from .yaml_file import read_yaml

GIB = 2**30
GB = 10**9
_ENV_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=.*$")


@dataclass(kw_only=True)
class ClusterConfig:
    """One site's GPU nodes: hardware figures, Slurm defaults and the job environment."""

    site: str = "generic"
    """Site name; used in reports and to find `scripts/slurm/<site>.sbatch`."""

    gpu_model: str = "A100-SXM4-40GB"
    """GPU model, as the site documents it (informational)."""

    gpus_per_node: int = 4
    """GPUs (and so training processes) per node; a node is one failure domain."""

    gpu_memory_gib: float = 40.0
    """Memory of one GPU in GiB."""

    host_memory_gib: float = 256.0
    """Host (CPU) memory of one node in GiB, shared by its GPUs' processes."""

    memory_reserve_fraction: float = 0.1
    """Share of GPU and host memory kept free for the CUDA context, NCCL buffers, allocator
    fragmentation and the OS; the planner's fit checks use the rest."""

    gpu_tflops: float = 312.0
    """Dense bf16 peak of one GPU in TFLOP/s (A100: 312, H100 SXM / GH200: 989)."""

    intra_node_gb_s: float = 100.0
    """GPU-to-GPU bandwidth inside a node, GB/s per direction between two GPUs (NVLink);
    0 when a node has a single GPU."""

    host_device_gb_s: float = 25.0
    """GPU-to-host copy bandwidth per GPU, GB/s per direction (PCIe 4.0 x16: ~25,
    NVLink-C2C: 450); bounds snapshots and replicas kept in host memory."""

    nics_per_node: int = 4
    """Inter-node network interfaces per node."""

    nic_gb_s: float = 25.0
    """Bandwidth of one NIC in GB/s per direction (200 Gb/s = 25 GB/s, 400 Gb/s = 50 GB/s)."""

    slurm_partition: str = ""
    """Slurm partition (`-p`); empty: the site default."""

    slurm_account: str = ""
    """Slurm account (`-A`); empty: give it with `sbatch -A` or SBATCH_ACCOUNT."""

    slurm_constraint: str = ""
    """Slurm node constraint (`-C`), e.g. `gpu` or `gpu&hbm80g` on Perlmutter."""

    slurm_qos: str = ""
    """Slurm quality of service (`-q`); empty: the site default."""

    modules: list[str] = field(default_factory=list)
    """Environment modules the job loads (`module load ...`)."""

    env: list[str] = field(default_factory=list)
    """Environment of every training process as NAME=VALUE entries (network/NCCL settings);
    the site's sbatch script sets each of them as an overridable default."""

    def __post_init__(self) -> None:
        if not isinstance(self.site, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.site):
            raise ConfigError(
                f"cluster.site: {self.site!r} must be a non-empty name of letters, digits, "
                "'.', '_' or '-'"
            )
        for name in ("gpus_per_node", "nics_per_node"):
            check_number(getattr(self, name), f"cluster.{name}", integer=True, minimum=1)
        for name in ("gpu_memory_gib", "host_memory_gib", "gpu_tflops", "nic_gb_s"):
            check_number(getattr(self, name), f"cluster.{name}", above=0)
        check_number(self.host_device_gb_s, "cluster.host_device_gb_s", above=0)
        check_number(self.intra_node_gb_s, "cluster.intra_node_gb_s", minimum=0)
        if self.gpus_per_node > 1 and self.intra_node_gb_s == 0:
            raise ConfigError(
                "cluster.intra_node_gb_s: must be positive when a node has more than one GPU"
            )
        check_number(
            self.memory_reserve_fraction, "cluster.memory_reserve_fraction", minimum=0, below=1
        )
        for i, entry in enumerate(self.env):
            if not _ENV_ENTRY.match(entry):
                raise ConfigError(
                    f"cluster.env[{i}]: {entry!r} is not NAME=VALUE (NAME: letters, digits, _)"
                )

    @property
    def inter_node_gb_s(self) -> float:
        """Aggregate inter-node bandwidth of one node, GB/s per direction."""
        return self.nics_per_node * self.nic_gb_s

    @property
    def inter_node_gb_s_per_gpu(self) -> float:
        """Each GPU's share of its node's inter-node bandwidth when all send at once."""
        return self.inter_node_gb_s / self.gpus_per_node

    @property
    def usable_gpu_bytes(self) -> int:
        """GPU memory the planner may fill, after the reserve."""
        return int(self.gpu_memory_gib * GIB * (1 - self.memory_reserve_fraction))

    @property
    def usable_host_bytes(self) -> int:
        """Host memory of one node the planner may fill, after the reserve."""
        return int(self.host_memory_gib * GIB * (1 - self.memory_reserve_fraction))

    @property
    def env_mapping(self) -> dict[str, str]:
        """`env` as a NAME -> VALUE mapping."""
        return dict(entry.split("=", 1) for entry in self.env)


def cluster_from_mapping(data: object, *, where: str = "cluster") -> ClusterConfig:
    """Validate one `cluster:` section."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of cluster keys")
    return from_mapping(ClusterConfig, data, where=where)


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read a cluster description: a YAML file whose only section is `cluster:`."""
    p = Path(path)
    data = read_yaml(p, "cluster")
    if not isinstance(data, dict) or set(data) != {"cluster"}:
        raise ConfigError(
            f"{p.name}: expected one top-level section 'cluster:' holding the cluster keys"
        )
    return cluster_from_mapping(data["cluster"], where=f"{p.name}.cluster")
