"""An OpenAI-compatible server over the course engine (chapter 13).

- `api`: the request bodies (pydantic) and OpenAI-style errors;
- `detokenize`: incremental, UTF-8-safe detokenization and stop strings with hold-back;
- `choices`: one choice's text side (detokenizer, stop strings, finish reason, logprobs);
- `logprobs`: OpenAI's completions `logprobs` object (token names by bytes, the sampled token);
- `engine_loop`: the engine in one background thread, fed by a thread-safe queue;
- `job`: one HTTP request's life: streamed or collected, aborted when its client leaves;
- `metrics`: `/metrics` in Prometheus' text format (vLLM's names), and reading it back;
- `auth`: `--api-key` (Bearer tokens on `/v1/*`) and the refusal to serve beyond loopback open;
- `server`: the FastAPI app, `/health`, errors; `ServerThread` (uvicorn in a thread);
- `models`: the served models (`course`, `smollm2`) and their tokenizers;
- `load`: a load generator (wall-clock Poisson arrivals), TTFT/TPOT percentiles and goodput;
- `python -m kvlib.serve --model {course,smollm2}`: the command line.
"""
