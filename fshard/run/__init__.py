"""One step's runtime: ``StepRun`` and ``UnitRun`` (gather, bind, free, re-gather, reduce hook), the routing of
unit calls to the running step, routed groups, activation checkpointing, and parameter reads ahead."""
