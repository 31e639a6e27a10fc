"""The sampling side: rollout producers, and the evaluator, which samples the policy too.

- The loop: ``producer`` (``main`` and the per-row step), ``trips`` (the two server round
  trips of a group: claim, publish), ``transport`` (where server calls and sampling run),
  ``inflight`` and ``heartbeat`` (many rows in flight, their leases kept alive),
  ``outages`` (engine down, failures every row shares), ``shutdown``, ``stats``.
- A row's group: ``dataset``, ``render`` (chat template, stop ids), ``single_turn`` (the
  default rollout), ``rollout_service`` (a rollout behind a URL), ``episodes`` (episodes
  checked into wire samples), ``rewards`` and ``judge``, ``components`` (all of these
  built from a config).
- Sampling: ``samplers`` (in-process transformers), ``remote_sampler`` and ``engines``
  (vLLM, SGLang, OpenAI-compatible servers), ``follow`` and ``reload`` (new policy
  versions), ``proxy`` and ``openai_chat`` (an OpenAI endpoint for black-box agents).
- ``evaluator``, ``eval_sets``, ``eval_rollouts``: `streamer eval`. ``fake_server`` and
  ``httpd``: a completions server for tests and benches.
"""
