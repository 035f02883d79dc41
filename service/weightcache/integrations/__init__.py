"""Engine integrations: take a model's weights from weightcache with one flag.

- :mod:`weightcache.integrations.vllm`: a vLLM model loader, load format
  ``weightcache``, registered through the ``vllm.general_plugins`` entry point
  (``pip install weightcache[vllm]``).
- :mod:`weightcache.integrations.transformers`: ``from_pretrained(path)``
  builds a transformers model on the meta device and takes its parameters and
  buffers from :func:`weightcache.attach`.

- :mod:`weightcache.integrations.params`: what every engine shares,
  :func:`~weightcache.integrations.params.register_tensors` (attached tensors
  become the parameters and buffers of the same names in a module tree, tied
  names one object) and ``private_names``.

A new engine is one file here: build the engine's model on the meta device,
``register_tensors``, run the engine's own post-processing, check
``private_names``. Importing this package imports no engine (and no torch).
See ``docs/engines.md``.

Forbidden imports: weightcache.daemon (engines talk to the service only
through :func:`weightcache.attach`).
"""
