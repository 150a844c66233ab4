"""The driver: one run in the launching process, top-down (checks before Ray, the lifecycle, the launch, the ending)."""
