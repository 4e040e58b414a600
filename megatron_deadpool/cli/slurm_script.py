"""`deadpool slurm-script [SITE]`: print a site's sbatch script (list the sites without SITE).

    deadpool slurm-script perlmutter > job.sbatch && sbatch -A <account> --nodes=3 job.sbatch

The script is the packaged copy of the repository's scripts/slurm/SITE.sbatch, unchanged; it
runs the package's own launcher when it is submitted from a folder without the repository's
scripts/ (`deadpool files --path scripts/slurm/deadpool_launch.sh`).
"""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from .files import locate, packaged


def sites() -> list[str]:
    """The sites with an sbatch script: perlmutter, vista, ..."""
    prefix, suffix = "scripts/slurm/", ".sbatch"
    return [
        name.removeprefix(prefix).removesuffix(suffix)
        for name in packaged()
        if name.startswith(prefix) and name.endswith(suffix)
    ]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `deadpool slurm-script`'s argument."""
    parser.add_argument("site", nargs="?", help="the site (default: list the sites)")


def run(args: argparse.Namespace) -> int:
    """Print SITE's sbatch script, or the list of sites."""
    known = sites()
    if args.site is None:
        print("\n".join(known))
        return 0
    if args.site not in known:
        raise ConfigError(f"unknown site {args.site!r}: one of {', '.join(known)}")
    sys.stdout.write(locate(f"scripts/slurm/{args.site}.sbatch").read_text())
    return 0
