"""The run folder's layout: the names of what a training run writes into its output folder, spelled once."""

CHECKPOINT_PREFIX = "checkpoint-"  # a checkpoint is the folder checkpoint-<optimizer step>
