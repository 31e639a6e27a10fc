"""A single-turn verifiers environment on the demo's addition rows, for tests/test_envs.py.

One agent answers ``a+b=`` once; the rubric pays 1.0 when the reply starts with the sum.
Its agent runs :class:`producers.envs.verifiers_harness.ChatHarness` in-process.
"""

import verifiers.v1 as vf

from producers.envs.verifiers_harness import ChatHarness
from streamer import demo


class AdditionData(vf.TaskData):
    answer: str


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def correct(self, task: AdditionData, trace) -> float:
        return 1.0 if trace.last_reply[:1] == task.answer else 0.0


class AdditionTaskset(vf.Taskset[AdditionTask]):
    def load(self):
        for row in demo.rows("train"):
            yield AdditionTask(AdditionData(prompt=row["messages"][0]["content"], answer=row["answer"]))


__all__ = ["AdditionTaskset", "ChatHarness"]
