"""The serve action's internals: which stored files a recipe serves (served), the generation
engine, transformers' continuous batching (batching), the served model over it (generation), the
OpenAI-compatible FastAPI app (app), and the vLLM command line for GPU machines (vllm). Imports
no stage module."""
