"""Models: the tiny default built from a config, and a trained model loaded for the stages
after training."""
