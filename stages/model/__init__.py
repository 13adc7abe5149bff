"""Models: the tiny default built from a config (tiny), a trained model loaded for the stages
after training (trained), AMD Quark's quantization and export (quark), and the numeric mode
training and the stages after it compute in (numerics)."""
