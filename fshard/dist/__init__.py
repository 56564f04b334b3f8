"""Ranks and their collectives: ``Mesh``, the step's ``Comm``, how ranks agree (the check before each collective,
the descriptors every rank raises with), and ``Call``, a collective call outside a step."""
