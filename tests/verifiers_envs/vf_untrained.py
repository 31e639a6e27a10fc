"""A verifiers environment whose one seat it marks untrainable, for tests/test_verifiers_env.py:
the proxy would train that seat's calls anyway, so the adapter must refuse the rollout."""

import verifiers.v1 as vf
from vf_addition import AdditionTaskset

from producers.envs.verifiers_harness import ChatHarness


class UntrainedConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class UntrainedEnv(vf.Env[UntrainedConfig]):
    async def setup(self, agents) -> None:
        agents.agent.trainable = False  # as a simulated user's seat is

    async def run(self, task, agents) -> None:
        await agents.agent.run(task)


__all__ = ["AdditionTaskset", "ChatHarness", "UntrainedEnv"]
