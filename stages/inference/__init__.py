"""The serve action's internals: which stored files a recipe serves (served), the model and its
generation through transformers (generation), the OpenAI-compatible FastAPI app over it (app),
and the vLLM command line for GPU machines (vllm). Imports no stage module."""
