"""`minivllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM, in one
process with the frontend, as vLLM's `vllm serve`."""
