"""Process groups, the device mesh and the parallelization plan applied to a model."""
