"""The generator role: an inference engine per instance that streams finished samples to the trainer.

- ``engine``: the :class:`GenerationEngine` interface, its records and the factory by type.
- ``vllm_engine`` / ``worker_ext``: vLLM (GPU and CPU builds, one code path) and the worker
  extension through which its workers receive and reload weights in place.
- ``stream``: dispatched requests to engine requests, results to wire samples, the meter.
- ``weights``: where each weight version comes from (the trainer's group, or the site's relay).
- ``main``: the role program (``roles.generator.program=streamrl_cli.generator.main:main``).

Nothing here imports vLLM or torch at package import time.
"""
