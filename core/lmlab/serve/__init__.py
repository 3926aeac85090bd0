"""``lmlab serve``: an OpenAI-compatible HTTP endpoint over a trained run, continuous batching inside.

Nothing here is imported until ``lmlab serve`` runs (fastapi and uvicorn are imported by
:mod:`lmlab.serve.app` only): ``lmlab plugins`` and ``lmlab check`` stay fast.

- :mod:`lmlab.serve.protocol`: the request bodies (pydantic) and the OpenAI error object.
- :mod:`lmlab.serve.decoding`: the run's token-level decoder, and requests' fields as its options.
- :mod:`lmlab.serve.scheduler`: the decode loop, one background thread owning the engine.
- :mod:`lmlab.serve.service`: the loaded run: prompts to token ids, limits, chat rendering.
- :mod:`lmlab.serve.memory`: whether ``--max-batch`` rows of key/value cache fit in memory.
- :mod:`lmlab.serve.app`: the FastAPI routes and ``serve()`` (uvicorn).
"""
