"""The one boundary with RLlib: our schema onto `AlgorithmConfig`, RLlib's results onto our tags,
checkpointed policies loaded for inference. A Ray upgrade touches this package and `internals`."""
