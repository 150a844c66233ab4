"""Tracking: the MLflow run (opened by the driver, fed by rank 0's sender), its plots and the runs table."""
