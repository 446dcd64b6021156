"""The ``carpool`` command (``main``): one verb per process kind, the embedded stack of ``carpool up``,
and the clients ``carpool submit`` and ``carpool batch``. ``python -m gateway.cli`` runs it too."""
