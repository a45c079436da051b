"""``CheckpointError``: the one error for a checkpoint that cannot be used, shared by the loader and the models."""


class CheckpointError(ValueError):
    """The checkpoint directory, its config or its weights cannot be used as given."""
