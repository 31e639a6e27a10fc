"""Samplers: prompt token ids -> G completions with the log-prob of every sampled token.

One small interface (:class:`Sampler`), two implementations: :class:`LocalSampler`
(a transformers causal LM in this process, CPU or GPU) and
:class:`producers.remote_sampler.RemoteSampler` (an OpenAI-compatible server such as
vLLM or SGLang). Both return :class:`Completion` objects: the completion token ids up to
and including the first stop token (EOS), one log-prob per token, and ``finish_reason``
("stop" when a stop token ended it, "length" when ``max_new_tokens`` cut it).

Which log-prob is reported: the log-prob of the sampled token under the distribution it
was actually sampled from: ``log_softmax(logits / temperature)`` restricted and
renormalised to the top-p nucleus. With ``temperature == 1`` and ``top_p == 1`` (the
default) that is the model's plain log-softmax, which is what the trainer's importance
correction compares against. ``temperature == 0`` means greedy decoding and reports the
plain log-softmax. (vLLM reports raw, untempered log-probs by default; start it with
``--logprobs-mode processed_logprobs`` to match this definition when temperature != 1, and
say so with ``producer.remote_logprobs = "processed"``: with "raw", a temperature other than
0 or 1, or top_p < 1, is a config error.)

The trainer computes its log-probs at the same temperature (``softmax(logits / T)``), so on
fresh data its importance weight ``exp(prox - sampler)`` is 1 up to numerics. It does not
apply top-p: with ``top_p < 1`` the sampler's log-prob is renormalised over the nucleus,
``log p_T(x) - log Z`` with ``Z`` the nucleus mass, so every weight is ``Z <= 1`` (a token
drawn where the distribution is flat is down-weighted most) and ``mismatch_kl`` is above 0
for that reason alone. Use ``top_p = 1`` for training, as verl and AReaL recommend.
"""

from __future__ import annotations

import logging
from pathlib import Path

from streamer.errors import WeightsError
from streamer.rollout.contract import Completion, FinishReason, Sampler, SamplerError

__all__ = ["Completion", "FinishReason", "LocalSampler", "Sampler", "SamplerError", "cut_at_stop"]

log = logging.getLogger(__name__)


def _seed(device, seed: int) -> None:
    """Seed the generator that samples on ``device``. On a CPU that is the default generator
    alone: ``torch.manual_seed`` also seeds every accelerator's (lazily, recording a stack
    trace each time), ~0.3 ms a call, a twentieth of a batched generate of the demo."""
    import torch

    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def cut_at_stop(token_ids: list[int], logprobs: list[float], stop_ids) -> Completion:
    """Keep tokens up to and including the first stop token."""
    stops = set(stop_ids)
    for i, t in enumerate(token_ids):
        if t in stops:
            return Completion(list(token_ids[: i + 1]), list(logprobs[: i + 1]), "stop")
    return Completion(list(token_ids), list(logprobs), "length")


class LocalSampler:
    """Batched ``model.generate`` of the G completions of a prompt (or of many prompts)."""

    def __init__(self, model, *, stop_ids: list[int], pad_id: int | None = None):
        self.model = model.eval()
        self.stop_ids = list(stop_ids)
        self.pad_id = pad_id if pad_id is not None else self.stop_ids[0]

    @property
    def device(self):
        return next(self.model.parameters()).device

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed=None):
        return self.sample_many(
            [prompt_ids],
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=seed,
        )[0]

    def sample_many(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        """``n`` completions of each prompt, generated as one left-padded batch."""
        import torch

        if seed is not None:
            _seed(self.device, seed)
        ids, mask = self._batch(prompts, n)  # (B, P) with B = len(prompts) * n
        greedy = temperature == 0
        # top_k=0 turns off the top-k warper transformers would otherwise apply by default
        sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=not greedy,
                max_new_tokens=max_new_tokens,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
                return_dict_in_generate=True,
                output_scores=True,
                **sampling,
            )
            new = out.sequences[:, ids.shape[1] :]  # (B, T)
            # scores[t] (B, V) are the processed logits step t sampled from; one step at a time
            # keeps memory at B x V instead of B x T x V
            lp = torch.stack(
                [
                    torch.log_softmax(s.float(), dim=-1).gather(-1, new[:, t : t + 1]).squeeze(-1)
                    for t, s in enumerate(out.scores)
                ],
                dim=1,
            )  # (B, T)
        rows = [cut_at_stop(t, p, self.stop_ids) for t, p in zip(new.tolist(), lp.tolist())]
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _batch(self, prompts, n):
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts) * n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            rows = slice(i * n, (i + 1) * n)
            ids[rows, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[rows, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def load_weights(self, directory: Path) -> None:
        """Load a version in place; a version that does not fit the model (names, shapes,
        dtypes) raises WeightsError before anything changes (streamer/weights.py).

        A LoRA adapter version is applied on top of the base (the model is wrapped once).
        """
        from streamer import lora, weights

        if lora.is_adapter(directory):
            try:
                self.model = lora.load_adapter(self.model, directory).eval()
            except (lora.AdapterError, ValueError, KeyError, OSError) as e:
                raise WeightsError(f"cannot apply the LoRA adapter in {directory}: {e}") from e
            return

        weights.load_into(self.model, directory, mapped=True)

    def close(self) -> None:
        pass
