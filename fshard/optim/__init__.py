"""The optimizer (``fs.adamw`` on flat shards) and the learning-rate schedules (``fs.schedules``)."""
