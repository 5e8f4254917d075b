"""An OpenAI-compatible server over the course engine (chapter 13).

- `api`: the request bodies (pydantic) and OpenAI-style errors;
- `detokenize`: incremental, UTF-8-safe detokenization and stop strings with hold-back;
- `choices`: one choice's text side (detokenizer, stop strings, finish reason, logprobs);
- `engine_loop`: the engine in one background thread, fed by a thread-safe queue;
- `server`: the FastAPI app, server-sent events, aborts; `ServerThread` (uvicorn in a thread);
- `models`: the served models (`course`, `smollm2`) and their tokenizers;
- `load`: a load generator (wall-clock Poisson arrivals), TTFT/TPOT percentiles and goodput;
- `python -m kvlib.serve --model {course,smollm2}`: the command line.
"""
