"""The recorded rollouts as a stack: what a user's RL run's engine reported, served as an inference side."""
