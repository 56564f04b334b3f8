"""The stage protocols a transform's policies follow (``GatherPolicy`` ... ``UpdatePolicy``, the views they
receive, ``Grads``) and ``Transform`` with ``fold``, which composes transforms."""
