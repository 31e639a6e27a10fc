"""Readers of the trajectory and metrics streams: the trainer, the exporter, the archiver.

Nothing here imports ``producers/``: the evaluator samples the policy like a producer
does (task, sampler, weight follower) and lives there.

The trainer is split so its core never sees Redis: ``losses`` (the objective, pure tensor
functions), ``batch`` (groups -> padded tensors), ``filters`` (which groups to train),
``learner`` (the training step) and ``checkpoint`` (atomic, pickle-free state) know
nothing of streams; ``feed`` (the background reader), ``versions`` (the weight writer and
WeightSync publisher), ``resume`` (what a starting trainer reads back from the server) and
``trainer`` (the process) do.
"""
