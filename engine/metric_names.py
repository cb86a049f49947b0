"""Prometheus metric names: what the server exports and what the traffic reader queries (torch-free).

Anneal's own names first; the vLLM and SGLang equivalents let the operator watch engines that are
not ours. Histograms are exported with the usual ``_bucket``/``_sum``/``_count`` suffixes, counters
with ``_total``.
"""

PREFIX = "anneal"

# Per-request histograms.
PROMPT_TOKENS = "anneal_request_prompt_tokens"  # histogram, buckets up to 128k
GENERATION_TOKENS = "anneal_request_generation_tokens"  # histogram
TTFT = "anneal_time_to_first_token_seconds"  # histogram
ITL = "anneal_inter_token_latency_seconds"  # histogram
REQUEST_LATENCY = "anneal_request_latency_seconds"  # histogram (end to end)
# Per-step.
BATCH_SIZE = "anneal_batch_size"  # histogram: sequences in one engine step
NUM_RUNNING = "anneal_num_requests_running"  # gauge
NUM_WAITING = "anneal_num_requests_waiting"  # gauge
KV_FREE_BLOCKS = "anneal_kv_cache_free_blocks"  # gauge
# Counters (exported as <name>_total).
PREFIX_QUERIED = "anneal_prefix_cache_queried_tokens"
PREFIX_HIT = "anneal_prefix_cache_hit_tokens"
SPEC_DRAFTED = "anneal_spec_decode_draft_tokens"  # drafted by speculative decoding (scheduler.speculative_tokens)
SPEC_ACCEPTED = "anneal_spec_decode_accepted_tokens"  # of those, the ones the model agreed with
PROMPT_TOKENS_TOTAL = "anneal_prompt_tokens"
GENERATION_TOKENS_TOTAL = "anneal_generation_tokens"
REQUESTS = "anneal_requests"  # label status=success|error|aborted, finish_reason
# Info.
PLAN_INFO = "anneal_plan_info"  # gauge = 1, label plan_hash

# Bucket edges for token-count histograms: powers of two up to 128k.
TOKEN_BUCKETS = tuple(float(2**i) for i in range(0, 18))  # 1 .. 131072
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
