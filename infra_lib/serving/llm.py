"""Offline inference, vLLM's ``LLM`` API: submit every prompt at once, run the engine until all finish.

    llm = LLM(model, tokenizer)
    outputs = llm.generate(["What is Python?", "Name three primary colours."], SamplingParams(max_new_tokens=32))

Continuous batching does the rest: the prompts share every step, a finished request's place
goes to the next one at once.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from infra_lib.model.model import Llama
from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.engine import LLMEngine, RequestOutput
from infra_lib.serving.scheduler_output import SchedulerConfig


class LLM:
    """Offline inference as in vLLM: submit every prompt, run the engine until all finish.

    Args:
        model, tokenizer, config: as for ``LLMEngine.from_model``; or pass a ready ``engine``.
    """

    def __init__(
        self,
        model: Llama | None = None,
        tokenizer=None,
        config: SchedulerConfig = SchedulerConfig(),
        engine: LLMEngine | None = None,
    ):
        if engine is None and model is None:
            raise ValueError("LLM needs a model (or a ready engine)")
        self.engine = engine if engine is not None else LLMEngine.from_model(model, tokenizer, config)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] = SamplingParams(),
        *,
        stop: tuple[str, ...] = (),
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Finished outputs in the order of ``prompts``: one prompt (text, token ids, a conversation) or a list.

        ``sampling_params`` is one for all or one per prompt; a progress bar counts finished requests.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]  # one prompt: a text, a list of token ids or one conversation
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        ids = [self.engine.add_request(p, sp, stop=stop) for p, sp in zip(prompts, params)]
        done: dict[int, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for o in self.engine.step():
                    if o.finished:
                        done[o.request_id] = o
                        bar.update(1)
        return [done[i] for i in ids]
