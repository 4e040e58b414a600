"""`deadpool megatron-lm`: run a Megatron-LM training script on this machine with DeadPool.

    deadpool megatron-lm --nproc-per-node 4 PATH/pretrain_gpt.py <Megatron args> \\
        --deadpool --deadpool-spares 1 --deadpool-ranks-per-node 2

Everything after the script path goes to the script unchanged (Megatron's flags and the
`--deadpool-*` flags, which the runner adds to Megatron's parser).
"""

from __future__ import annotations

import argparse

from ..config.numbers import number_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",  # torchrun's spelling, as Megatron-LM's examples write it
        dest="nproc_per_node",
        type=number_arg(integer=True, minimum=1),
        required=True,
        metavar="N",
        help="active ranks to start on this machine (spares come on top: --deadpool-spares)",
    )
    parser.add_argument(
        "--nnodes",
        type=number_arg(integer=True, minimum=1),
        default=1,
        metavar="1",
        help="as torchrun's: nodes of the job; this launcher runs one machine (1). On a Slurm "
        "cluster use scripts/slurm/deadpool_launch.sh",
    )
    parser.add_argument(
        "--patched",
        action="store_true",
        help="run the script itself (patched by scripts/apply_patches.sh) instead of through "
        "the zero-edit runner",
    )
    parser.add_argument("--run-dir", help="directory for per-process logs and summary.json")
    parser.add_argument(
        "--node-agents",
        action="store_true",
        help="one `deadpool agent` per simulated node (--deadpool-ranks-per-node ranks) starts "
        "and respawns its processes, as on a cluster (default: this launcher is every node's "
        "agent); their output is followed in RUN_DIR/task-*.log",
    )
    parser.add_argument(
        "--timeout",
        type=number_arg(above=0, unit="seconds"),
        default=3600.0,
        help="wall-clock limit of the job in seconds",
    )
    parser.add_argument("script", help="the Megatron-LM training script, e.g. pretrain_gpt.py")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="the script's arguments, unchanged"
    )


def run(args: argparse.Namespace) -> int:
    import os

    from ..config.torchrun import refuse_torchrun
    from ..errors import ConfigError

    refuse_torchrun(os.environ, "megatron-lm")
    from ..devices import gloo

    gloo.check_settings()  # what every process would refuse, refused once here
    if args.nnodes != 1:
        raise ConfigError(
            f"--nnodes: {args.nnodes}; `deadpool megatron-lm` starts the ranks of one machine "
            "(1). For several nodes run scripts/slurm/deadpool_launch.sh in a Slurm allocation"
        )
    from ..megatron_lm.launch import MegatronLauncher

    launcher = MegatronLauncher(
        args.script,
        args.script_args,
        args.nproc_per_node,
        patched=args.patched,
        run_dir=args.run_dir,
        timeout_s=args.timeout,
        node_agents=args.node_agents,
    )
    return launcher.run()


def main() -> int:
    """`python -m megatron_deadpool.cli.megatron_lm ...`, the same as `deadpool megatron-lm`."""
    import sys

    from ..errors import ConfigError

    parser = argparse.ArgumentParser(
        prog="deadpool megatron-lm", description=__doc__.splitlines()[0]
    )
    configure(parser)
    try:
        return run(parser.parse_args())
    except ConfigError as exc:
        print(f"deadpool: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
