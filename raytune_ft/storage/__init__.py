"""Storage: the run's filesystem (local, shared or S3), its checks and errors, and the run folder's lease."""
