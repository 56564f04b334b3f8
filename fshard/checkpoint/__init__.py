"""``fs.save``, ``fs.load``, ``fs.latest``: DCP checkpoints in FSDP2's layout, the files of a checkpoint
directory, and what a load trusts a checkpoint for."""
