#!/usr/bin/env python3
"""Copy the CRDs generated into crds/ (hack/gen_crd.py) into the chart's crds/ folder.

Helm installs charts/tandem/crds/ before anything else and never upgrades it, so the copy must
be byte-identical to crds/; tests/chart checks that it is.

    python hack/sync_chart_crds.py           # copy
    python hack/sync_chart_crds.py --check   # exit 1 and name what differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "crds"
CHART_CRDS = REPO / "charts" / "tandem" / "crds"


def source_crds() -> dict[str, bytes]:
    """File name -> content of every CRD in crds/ (samples/ holds example resources, not CRDs)."""
    return {path.name: path.read_bytes() for path in sorted(SOURCE.glob("*.yaml"))}


def differences() -> list[str]:
    wanted = source_crds()
    have = {path.name: path.read_bytes() for path in sorted(CHART_CRDS.glob("*.yaml"))}
    problems = [f"{name}: missing from the chart" for name in wanted if name not in have]
    problems += [f"{name}: differs from crds/{name}" for name in wanted if name in have and have[name] != wanted[name]]
    problems += [f"{name}: in the chart but not in crds/" for name in have if name not in wanted]
    return problems


def sync() -> list[str]:
    CHART_CRDS.mkdir(parents=True, exist_ok=True)
    wanted = source_crds()
    for stale in CHART_CRDS.glob("*.yaml"):
        if stale.name not in wanted:
            stale.unlink()
    for name, content in wanted.items():
        (CHART_CRDS / name).write_bytes(content)
    return list(wanted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the chart's CRDs differ from crds/")
    args = parser.parse_args(argv)
    if not source_crds():
        print("crds/ has no CRD yet; run python hack/gen_crd.py first", file=sys.stderr)
        return 1
    if args.check:
        problems = differences()
        for problem in problems:
            print(f"charts/tandem/crds/{problem} (run python hack/sync_chart_crds.py)", file=sys.stderr)
        return 1 if problems else 0
    for name in sync():
        print(f"copied crds/{name} -> charts/tandem/crds/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
