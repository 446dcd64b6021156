"""What every carpool process does at its edge: command-line flags from config dataclasses with their
``CARPOOL_<FLAG>`` fallbacks (``flags``), the ``--model`` check and the offline environment
(``model_path``), text for a terminal (``terminal``), and cancellation of owned asyncio tasks (``tasks``)."""
