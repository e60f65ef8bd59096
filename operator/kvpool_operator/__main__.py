"""``python -m kvpool_operator``: run the operator (kopf, standalone: no peering objects).

Watches the namespaces in ``KVPOOL_OPERATOR_NAMESPACES`` or, when unset, the whole
cluster. A pool in a namespace it does not watch is never reconciled: the operator
cannot see it (nor may it, with the chart's namespaced RBAC), so it says at start-up
which namespaces it serves. Other settings: :mod:`kvpool_operator.settings`.
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

logger = logging.getLogger("kvpool_operator")


def log_watch_scope(namespaces: Sequence[str]) -> None:
    """Say which namespaces' pools this operator serves, and that it never sees the others."""
    if not namespaces:
        logger.info("serving KVCachePools in every namespace")
        return
    logger.info("serving KVCachePools in namespace(s) %s only: a pool in any other namespace is never "
                "reconciled (no children, no status); add its namespace to KVPOOL_OPERATOR_NAMESPACES "
                "(the chart's watch.namespaces) or watch every namespace (watch.clusterWide)",
                ", ".join(namespaces))


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
    log_watch_scope(namespaces)
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=settings.liveness_endpoint,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
