"""``fs.offload_state``: optimizer moments (and parameter shards) held in stores and streamed through the
update (design/OFFLOAD.md): the transform, its update policy, the pipeline, and which units go to which tier."""
