"""``python -m ascendbind.daemon VERB``: the daemon verbs without the rest of the CLI."""

import argparse
import sys

from ..errors import AscendbindError
from . import cli_verbs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ascendbind")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    cli_verbs.register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AscendbindError as err:
        print(f"ascendbind: {err}", file=sys.stderr)
        return err.exit_status


if __name__ == "__main__":
    sys.exit(main())
