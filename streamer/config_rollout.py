"""The sections of the rollout side: ``[producer]``, ``[eval]`` (and its named sets), ``[reward]``."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from schemas.metric_names import DEFAULT_EVAL_SET
from streamer.config_base import NonNegFloat, NonNegInt, PosFloat, PosInt, Section

# Upper bounds where a typo would cost a machine rather than a config error. A row's samples
# are one batch of the sampler (10**9 of them ask for hundreds of GB at once). Each row,
# engine request or reward call in flight may hold a thread and a socket of its own: at 256
# each, a producer stays under the usual limit of 1,024 open files; past the thread limit it
# cannot go on at all. More throughput than this: more producers.
MAX_SAMPLES_PER_ROW = 1024
MAX_IN_FLIGHT = 256
SamplesPerRow = Annotated[int, msgspec.Meta(ge=1, le=MAX_SAMPLES_PER_ROW)]
InFlight = Annotated[int, msgspec.Meta(ge=1, le=MAX_IN_FLIGHT)]


class ProducerSection(Section):
    dataset: str = "demo"  # JSONL/parquet/Arrow file, a directory of them, or hf:owner/name[:split]; "demo" = the built-in task; reasoning_gym:NAME / verifiers:ENV_ID = an environment's rows
    group_size: SamplesPerRow = 8  # completions per prompt (G)
    min_group_size: PosInt = 2  # fewer good samples than this: the group is not published
    max_new_tokens: PosInt = 16  # completion length cap
    temperature: PosFloat = 1.0  # sampling temperature
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # nucleus sampling
    sampler: Literal["local", "remote"] = "local"  # transformers in-process, or an HTTP server
    remote_url: str = ""  # OpenAI-compatible server base URL (remote sampler)
    remote_model: str = ""  # model name sent to the server; empty = model.name_or_path
    remote_timeout: PosFloat = 120.0  # per HTTP request
    remote_retries: NonNegInt = 3  # bounded retries with backoff
    remote_concurrency: InFlight = 8  # in-flight requests per producer
    engine: Literal["vllm", "sglang", "openai"] = (
        "vllm"  # the remote server: how new versions reach it (docs/ENGINES.md)
    )
    reload_endpoint: str = ""  # "" = the engine's reload; else POST {"model_path": dir} here (SGLang's shape)
    lora_endpoint: str = ""  # "" = the engine's LoRA endpoint; else POST {"lora_name", "lora_path"} here
    inflight_updates: Literal["drain", "keep", "abort"] = (
        "drain"  # requests in flight at a reload: finish first, go on under the new weights, or restart from their tokens
    )
    remote_logprobs: Literal["", "raw", "processed"] = (
        ""  # what the server reports; "" = the engine's default
    )
    reward: str = ""  # "module:function" (row, text, sample) -> float, maybe async; "judge" = [reward.judge]; "math" = math-verify; "reasoning_gym" = the task's score_answer; "" = the dataset's default (demo reward / reasoning_gym / exact_match)
    lease_seconds: PosFloat = 60.0  # row lease; renewed while working, expired rows are re-issued
    epochs: NonNegInt = 0  # stop after this many passes over the dataset; 0 = forever
    max_groups: NonNegInt = 0  # stop after publishing this many groups; 0 = forever
    shutdown_grace: PosFloat = 30.0  # on SIGTERM: finish or hand back the current row within this
    torch_threads: NonNegInt = 0  # torch CPU threads of a local sampler; 0 = torch's default
    rollout: str = ""  # "module:function" async (row, ctx) -> episodes, a rollout service's http(s) URL, or "verifiers:ENV_ID"; "" = single-turn
    concurrency: InFlight = 1  # rollouts (rows) in flight at once, each with its own lease and admission slot
    rollout_timeout: NonNegFloat = 0.0  # cancel a rollout running longer (its row is handed back); 0 = never
    max_reply_bytes: PosInt = (
        67_108_864  # (64 MiB) a rollout service's or engine's answer larger drops the rollout
    )
    max_forks: PosInt = 64  # forks an episode may have (each one more sample of its group); more drops the episode (too_many_forks)
    max_row_attempts: NonNegInt = (
        3  # skip a row after this many failed rollouts (error, timeout, crash); 0 = never
    )
    defer_after: NonNegInt = (
        3  # set a row aside as solved once its last this many groups were all solved; 0 = never
    )
    defer_failed_after: NonNegInt = (
        10  # set a row aside once this many groups in a row taught nothing (some failed); 0 = never
    )
    defer_pass_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = (
        0.95  # also set a row aside as solved when its last group was solved and its recent pass rate is at least this; 0 = never
    )
    revisit_share: Annotated[float, msgspec.Meta(ge=0, lt=1)] = (
        0.1  # at most this share of the rows handed out are revisits of rows set aside
    )

    def __post_init__(self) -> None:
        if self.min_group_size > self.group_size:
            raise ValueError("`min_group_size` must be <= `group_size`")
        if self.sampler == "remote" and not self.remote_url:
            raise ValueError('`remote_url` is required when `sampler` is "remote"')
        transformed = self.temperature not in (0.0, 1.0) or self.top_p < 1
        if self.sampler == "remote" and self.logprobs_mode == "raw" and transformed:
            raise ValueError(
                f'`remote_logprobs` is "raw" ({self.engine}\'s default: log-probs before temperature and top-p) '
                f"but temperature = {self.temperature}, top_p = {self.top_p}: the trainer's importance "
                "weights would mix the sampling transform into staleness. Start vLLM with "
                '`--logprobs-mode processed_logprobs` and set remote_logprobs = "processed"'
            )

    @property
    def logprobs_mode(self) -> str:
        """What the remote server's log-probs are: ``remote_logprobs``, or the engine's default
        (vLLM: raw logits' log-softmax; SGLang: the distribution it sampled from)."""
        return self.remote_logprobs or ("processed" if self.engine == "sglang" else "raw")

    @property
    def untied_versions(self) -> bool:
        """Versions are written with ``lm_head`` stored and the config untied: vLLM's reload
        leaves a tied head at its start-up weights."""
        return self.sampler == "remote" and self.engine == "vllm"


SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # an eval set's name: a bare TOML key, a label value
DEFAULT_SET = DEFAULT_EVAL_SET  # the eval set of the [eval] keys themselves


class EvalSetSection(Section):
    """One named eval set, ``[eval.sets.NAME]``: its rows, sampling, rollout and reward."""

    dataset: str = ""  # required: held-out rows as producer.dataset takes them, "demo" or "demo:TASK" (the built-in eval splits)
    k: SamplesPerRow = 1  # samples per row, and the k of pass@k
    samples: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAMPLES_PER_ROW)] = (
        0  # completions per row n >= k for the unbiased pass@k; 0 = k
    )
    temperature: NonNegFloat = 0.0  # sampling temperature; 0 = greedy (one sample per row)
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # nucleus sampling
    max_rows: NonNegInt = 0  # evaluate at most this many rows; 0 = all
    max_new_tokens: NonNegInt = 0  # completion length cap; 0 = eval.max_new_tokens
    rollout: str = ""  # "module:function" or a rollout service URL; "" = producer.rollout
    reward: str = ""  # "module:function"; "" = producer.reward, else the dataset's default

    def __post_init__(self) -> None:
        if not self.dataset:
            raise ValueError("`dataset` is required: a file, a directory, hf:owner/name, or demo / demo:TASK")
        if self.samples and self.samples < self.k:
            raise ValueError(f"`samples` ({self.samples}) must be >= `k` ({self.k}), or 0 for k")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(
                f"`temperature` = 0 is greedy: the {self.n} samples of a row would be the same; "
                "set a temperature > 0 or k = 1"
            )

    @property
    def n(self) -> int:
        """Completions sampled per row."""
        return self.samples or self.k


class EvalSection(Section):
    dataset: str = "demo"  # held-out rows as producer.dataset takes them (a hub name: its test split); "demo" = the built-in task's eval split; "" = only eval.sets
    eval_every: PosInt = 1  # evaluate every k-th version
    max_rows: NonNegInt = 0  # evaluate at most this many rows; 0 = all
    max_new_tokens: PosInt = 16  # completion length cap (and of the sets that leave theirs 0)
    batch_size: PosInt = 32  # prompts per batched generate of a local model; rows in flight of a rollout
    max_versions: NonNegInt = 0  # stop after evaluating this many versions; 0 = forever (tests: burst)
    remote_url: str = (
        ""  # a server of the evaluator's own (engine: producer.engine); "" = sample like producers
    )
    remote_model: str = ""  # model name sent to eval.remote_url; empty = model.name_or_path
    sets: dict[str, EvalSetSection] = {}  # [eval.sets.NAME]: more named sets, evaluated after "default"

    def __post_init__(self) -> None:
        for name in self.sets:
            if name == DEFAULT_SET or not SET_NAME.fullmatch(name):
                raise ValueError(
                    f"`sets` has a set named {name!r}: use letters, digits, _ and - (at most 64), "
                    f'not {DEFAULT_SET!r} (the set of the [eval] keys; set eval.dataset = "" to drop it)'
                )
        if not self.dataset and not self.sets:
            raise ValueError("`dataset` is empty and there are no `sets`: nothing to evaluate")


JUDGE_TEMPLATE = (
    "Score the response to the question from 0 to 1.\n\nQuestion: {prompt}\n"
    "Reference answer: {answer}\n\nResponse: {completion}\n\nReply with the score only."
)


class JudgeSection(Section):
    """The built-in judge reward (``producer.reward = "judge"``): a model asked over HTTP."""

    url: str = ""  # chat: the judge's OpenAI-compatible base URL (…/v1); score, batch: the endpoint's URL
    kind: Literal["chat", "score", "batch"] = (
        "chat"  # chat: the number in the reply to `template`; score: {"score": x}; batch: a group a request
    )
    model: str = ""  # model name sent to a chat judge
    template: str = JUDGE_TEMPLATE  # a chat judge's prompt: {completion}, {prompt} and the row's fields
    api_key_env: str = ""  # environment variable holding the judge's API key (a bearer token); "" = none
    max_tokens: PosInt = 16  # reply length cap of a chat judge
    timeout: PosFloat = 60.0  # seconds per HTTP request to the judge
    retries: NonNegInt = 3  # more tries after an unreachable judge, a 429/5xx or a timeout (backoff)
    max_reply_bytes: PosInt = (
        1_048_576  # (1 MiB) a larger reply is not read on: the rollout is dropped (bad_reward)
    )


class RewardSection(Section):
    """How reward functions are awaited: async ones (the judge too) run concurrently."""

    concurrency: InFlight = 32  # async reward calls in flight at once per producer
    timeout: NonNegFloat = (
        300.0  # seconds per async reward call, retries included (past it: an outage); 0 = none
    )
    judge: JudgeSection = msgspec.field(default_factory=JudgeSection)  # [reward.judge]
