"""A multi-turn verifiers environment, for tests/test_envs.py: the demo's ``retry`` task.

The env answers a wrong reply with ``+`` (higher) or ``=`` (lower) as a user turn and the
agent tries again, up to three replies; the rubric pays 1.0 / 0.6 / 0.3 for a right first /
second / third reply, from the trace alone.
"""

import verifiers.v1 as vf

from producers.envs.verifiers_harness import ChatHarness
from streamer import demo

ATTEMPTS = 3
REWARDS = (1.0, 0.6, 0.3)


class RetryData(vf.TaskData):
    answer: str


class RetryTask(vf.Task[RetryData]):
    @vf.reward
    async def first_right_reply(self, task: RetryData, trace) -> float:
        replies = [(m.content or "").strip()[:1] for m in trace.assistant_messages]
        right = [i for i, reply in enumerate(replies) if reply == task.answer]
        return REWARDS[right[0]] if right and right[0] < ATTEMPTS else 0.0


class RetryTaskset(vf.Taskset[RetryTask]):
    def load(self):
        for row in demo.rows("train"):
            yield RetryTask(RetryData(prompt=row["messages"][0]["content"], answer=row["answer"]))


class RetryEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class RetryEnv(vf.Env[RetryEnvConfig]):
    async def run(self, task, agents) -> None:
        target = int(task.data.answer)
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()  # the task's prompt opens the exchange
            for _ in range(ATTEMPTS - 1):
                reply = segment.last_reply[:1]
                if segment.terminated or reply == task.data.answer:
                    return
                segment = await chat.turn("+" if not reply.isdigit() or int(reply) < target else "=")


__all__ = ["ChatHarness", "RetryEnv", "RetryTaskset"]
