"""One training run: the plan made before Ray starts, the algorithm's host, the loop, its run directory,
metrics, checkpoints and console lines."""
