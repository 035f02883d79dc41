"""Engine integrations: take a model's weights from weightcache with one flag.

- :mod:`weightcache.integrations.vllm`: a vLLM model loader, load format
  ``weightcache``, registered through the ``vllm.general_plugins`` entry point
  (``pip install weightcache[vllm]``).
- :mod:`weightcache.integrations.transformers`: ``from_pretrained(path)``
  builds a transformers model on the meta device and takes its parameters and
  buffers from :func:`weightcache.attach`.

Both import their engine lazily: importing this package imports neither vLLM
nor transformers. See ``docs/engines.md``.

Forbidden imports: weightcache.daemon (engines talk to the service only
through :func:`weightcache.attach`).
"""
