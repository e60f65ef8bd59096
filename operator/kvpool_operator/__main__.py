"""``python -m kvpool_operator``: run the operator (kopf, standalone: no peering objects).

Watches the namespaces in ``KVPOOL_OPERATOR_NAMESPACES`` or, when unset, the whole
cluster. Other settings: :mod:`kvpool_operator.settings`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

import kopf

from kvpool_operator.errors import SettingsError
from kvpool_operator.settings import OperatorSettings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool_operator", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = OperatorSettings.from_env()
    except SettingsError as e:
        print("kvpool-operator: {}".format(e), file=sys.stderr)
        return 2
    importlib.import_module("kvpool_operator.handlers")  # registers the handlers
    namespaces = settings.watch.namespaces
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=settings.liveness_endpoint,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
