"""The step: its decision (norm, skip, clip, masking), the loss scale, this rank's master rows and
their precision, the gate of the shard's writers, and the all-gather of the updated params."""
