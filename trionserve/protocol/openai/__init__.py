"""The OpenAI-compatible frontend: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/v1/embeddings`` over the models the server serves, as Triton's
``python/openai`` frontend maps them (``--openai-port``).

- :mod:`.schemas`: request bodies parsed and checked (sans-I/O), OpenAI's errors;
- :mod:`.engine`: an OpenAI request as an :class:`~trionserve.core.inference.InferenceRequest`
  for a model, and its responses as OpenAI's objects and stream chunks (sans-I/O);
- :mod:`.chat`: chat templates (a tokenizer's Jinja template, or the default one);
- :mod:`.frontend`: the route table on the HTTP transport, and ``serve_openai``.
"""
