"""Models: the tiny default built from a config (tiny), a trained model loaded for the stages
after training (trained), and AMD Quark's quantization and export (quark)."""
