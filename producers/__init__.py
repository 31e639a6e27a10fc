"""Rollout producers: dataset rows -> render -> sample -> reward -> publish.

Modules: ``dataset`` (JSONL rows, per-epoch order), ``leases`` (global claiming with
leases in Redis), ``render`` (chat template, stop ids), ``samplers`` (the interface and
the local transformers sampler), ``remote_sampler`` (OpenAI-compatible servers),
``rewards``, ``follow`` (loading new policy versions), ``stats`` (rollout metrics),
``components`` (building all of it from a config), ``producer`` (the loop and
``main``), ``fake_server`` (a completions server for tests and benches).
"""
