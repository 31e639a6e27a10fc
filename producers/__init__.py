"""The sampling side: rollout producers, and the evaluator, which samples the policy too.

Modules: ``dataset`` (JSONL rows, per-epoch order), ``render`` (chat template, stop ids),
``samplers`` (the local transformers sampler), ``remote_sampler`` (OpenAI-compatible
servers), ``reload`` (one reload per shared server and version), ``rewards``, ``follow``
(loading new policy versions), ``components`` (building a task and sampler from a
config), ``rollout`` (the default rollout, rollout services, checking episodes),
``proxy`` (an OpenAI-compatible endpoint for black-box agents), ``inflight`` and
``heartbeat`` (many rows in flight, their leases kept alive), ``stats`` (rollout
metrics), ``producer`` (the loop and ``main``), ``evaluator`` (`streamer eval`: greedy
scores of policy versions on held-out rows), ``fake_server`` (a completions server for
tests and benches).
"""
