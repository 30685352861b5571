"""The serving engine: one client for every engine, the embedded server and its batcher, the SGLang launcher.

- client.py    EngineClient: SGLang's native HTTP API, affinity, balancing, failover, weight updates
- server.py    the embedded engine (`dreamgym serve`): SGLang's API served by transformers on CPU or CUDA
- batcher.py   continuous batching over a transformers causal LM (the embedded engine's decode loop)
- sampling.py  next-token sampling (pure maths, tested against slow references)
- padding.py   the attention mask of a left-padded batch (no empty row: CUDA's bf16 kernels give NaN there)
- sglang.py    starting and supervising an SGLang server on a GPU node
- models.py    loading the models DreamGym serves and trains, offline only
- generate.py  `dreamgym generate`: one request to any SGLang-compatible endpoint

Imports only the kernel (infra/*.py); nothing here knows about actors, the simulator or the learner.
"""
