"""``python -m gateway.cli VERB ...``: the ``carpool`` command."""

from gateway.cli import run

raise SystemExit(run())
