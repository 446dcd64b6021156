"""``python -m gateway.cli VERB ...``: the ``carpool`` command."""

from gateway.cli.main import main

raise SystemExit(main())
