"""Running one model over several ranks: tensor-parallel groups and the executors that start the ranks."""
