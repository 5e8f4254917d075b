"""kvlib: the shared package of the course *KV Cache from Scratch*.

Three layers (book/architecture.md draws them), dependencies pointing one way:

1. the library: numpy references (`ref/`); one reader of `config.json` (`config`); the model and
   its layers (`model`, `layers/`), loaders (`loaders/`), `generation` and `training`; caches
   behind one interface (`cache/`); attention backends, launch rules and kernels (`ops/`,
   `kernels`); quantization (`quant`); the memory calculator (`memory/`); the serving engine
   (`engine/`); conversions to GQA and MLA (`conversions/`); quality metrics (`metrics/`);
2. the experiments (`experiments/`), one module per recorded result in `results/`, importing only
   the library;
3. the course machinery (`course/`: grading, checks, notebook helpers, timing, plots).

Shared exceptions live in `errors`. The names below are the stable API. They are imported lazily,
so `import kvlib` costs numpy only (chapter 1 runs without torch); modules that need torch or
triton import them when first used.
"""

from importlib import import_module

from kvlib._validate import check_shape

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "load_hf_checkpoint": "kvlib.loaders.hf",
    "load_course_model": "kvlib.loaders.course_model",
    "generate": "kvlib.generation",
    "kv_cache_bytes": "kvlib.memory",
    "paged_decode_attention": "kvlib.kernels",
    "load_gguf_checkpoint": "kvlib.loaders.gguf",
    "load_smollm2": "kvlib.loaders.smollm2",
    "KVCache": "kvlib.cache",
    "DynamicCache": "kvlib.cache",
    "StaticCache": "kvlib.cache",
    "LatentCache": "kvlib.cache",
    "PagedCache": "kvlib.cache",
    "EvictingCache": "kvlib.cache",
    "CompactingPagedCache": "kvlib.cache",
    "QuantizedCache": "kvlib.cache",
    "QuantizedPagedCache": "kvlib.cache",
    "QuantScheme": "kvlib.quant",
    "LLMEngine": "kvlib.engine",
    "SamplingParams": "kvlib.engine",
    "CacheOverflowError": "kvlib.errors",
    "OutOfBlocksError": "kvlib.errors",
    "UnsupportedConfigError": "kvlib.errors",
}
__all__ = ["__version__", "check_shape", *_API]


def __getattr__(name: str):
    if name in _API:
        value = getattr(import_module(_API[name]), name)
        globals()[name] = value  # import once
        return value
    raise AttributeError(f"module 'kvlib' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
