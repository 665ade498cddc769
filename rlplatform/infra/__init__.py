"""Ray infrastructure: a private local instance or a cluster, the cluster launcher, Ray Jobs, the system monitor."""
