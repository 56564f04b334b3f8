"""The step: ``fs.compose`` and ``Step`` (the call, ``eval``, ``plan``, ``close``), its guards, ``fs.Plan`` and the
simulated step that makes it, and ``fs.timeline``."""
