"""Engine facade — CONTRACT (implementation landing shortly; this docstring is the interface).

THE ENGINE API (being written right now by the lead in engine/llm.py, engine/sequence.py, engine/sampling_params.py; expected to land within ~60 minutes — check `git log --oneline` and the files; until then write against this interface):

    from anneal.engine.llm import Engine, EngineArgs
    from anneal.engine.sampling_params import SamplingParams
    from anneal.engine.sequence import RequestOutput
    engine = Engine(EngineArgs(model="random:tiny", device="cpu", plan=Plan(), layers=None,
                               max_model_len=None, num_kv_blocks=None, block_size=16, seed=0))
    engine.config            # ModelConfig: vocab_size, max_position_embeddings, eos_token_ids: list[int], name
    engine.max_model_len     # int: longest prompt+output accepted
    engine.add_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None   # ValueError on bad input (too long, empty, ...)
    engine.abort_request(request_id: str) -> bool   # frees its KV blocks at once
    engine.step() -> list[RequestOutput]            # one scheduler step: schedule -> run -> postprocess
    engine.has_unfinished_requests() -> bool
    engine.stats() -> EngineStats   # num_running, num_waiting, num_free_blocks, num_blocks, last_batch_size,
                                    # prefix_queried_tokens, prefix_hit_tokens (cumulative), steps
    engine.plan -> Plan ; engine.apply_plan(plan) -> ApplyReport (timings)   # hot reload, issue 4
    engine.generate(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]   # offline helper
    SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0 (0 = off), seed: int | None = None,
                   stop_token_ids: list[int] = [], ignore_eos: bool = False, logprobs: int | None = None)  # pydantic
    RequestOutput(request_id, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None,
                  finished: bool, finish_reason: "stop" | "length" | "abort" | None,
                  num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int)
    TokenLogprobs(token_id: int, logprob: float, top: dict[int, float])
The Engine is NOT thread-safe: one thread owns it and calls step(); other threads hand it add/abort through a queue. Stop *strings* are the server's job (detokenize and cut); stop token ids / EOS are the engine's.
"""
