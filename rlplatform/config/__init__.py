"""What an experiment is: the schema, its files and overrides, sizing to a cluster, env ids."""
