"""What the grader still checks once a visible check passes: one line per visible check.

A lab's test cell runs its visible checks for the learner and holds hidden checks (between
``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``) that only the grader runs. A ✓ on
the visible check is not the score, so ``check()`` prints the line below under it: what kind
of input the cell's hidden checks add (extreme values, traffic, other shapes, random
sequences, the real model), never the inputs themselves. A cell without hidden checks says
that the grader reruns the visible check on inputs drawn from its own seed.
"""

from __future__ import annotations

ALSO_CHECKS = "the grader also checks: "
NOTHING_HIDDEN = "this cell has no hidden checks: the grader reruns this check on new random inputs"

_SOFTMAX = (
    "logits of the order of ±10^4, where exp overflows unless each row is shifted by its own maximum, and "
    "rows that are mostly -inf or -inf in all but one place"
)
_CACHED_ATTENTION = (
    "several new tokens on top of a filled cache (t > 1 after a prefill), with one KV head shared by "
    "every query head (MQA) and one KV head per query head (MHA)"
)
_SIMULATED_TRACES = "request timings from the simulated serving engine, some failed, some with several tokens per chunk"

_TEXTS: dict[str, str | None] = {
    # lab 01
    "lab01.gemm_flops": "shapes whose count does not fit in 32 bits, a single row (a decode GEMV), a reduction of "
    "length one, and an empty dimension",
    "lab01.time_op_warmup": "an operation that only queues its work, as a GPU launch does, timed with a sync function, "
    "over an even number of timed calls",
    "lab01.dominant_op_real": "made-up profiles where a wrapper's total time nearly equals its child's, and GPU "
    "profiles where the kernels' device time, not the CPU's launch time, decides",
    "lab01.achieved_tflops": "a measured time of zero or below, which must raise ValueError",
    # lab 02
    "lab02.arithmetic_intensity": "one-row and small-batch shapes (decode) and other element sizes: 1 byte (fp8), "
    "4 (fp32) and half a byte (int4)",
    "lab02.attainable_flops": "the edges: exactly on the ridge point, just left of it, intensity 0, and far to the "
    "right",
    "lab02.kv_bytes_per_token": "grouped-query and multi-query models (fewer KV heads than query heads), and 1- and "
    "4-byte elements",
    "lab02.max_concurrency": "tight fits: weights or a reserve that alone overflow memory, exactly nothing left, one "
    "byte short of one more sequence, and contexts from 1 to 10 million tokens",
    # lab 03
    "lab03.softmax_odd_shapes": _SOFTMAX,
    "lab03.softmax_in_bounds": _SOFTMAX,
    "lab03.softmax_reads_once": None,
    "lab03.matmul_odd_shapes": "transposed (column-major) A, B and C, and tiles whose BLOCK_M and BLOCK_N differ",
    "lab03.matmul_in_bounds": "the bytes your kernel loads on these shapes: a lane that reads outside A or B fails "
    "even when C comes out right (counted when Triton runs in its interpreter)",
    "lab03.rmsnorm_odd_shapes": "the bytes your kernel loads: each row of x and the weights once, no lane past n_cols "
    "read even when its result is never stored (counted when Triton runs in its "
    "interpreter)",
    # lab 04
    "lab04.op_histogram": "graphs with submodule calls (an nn.Linear) and parameter reads next to the fusion patterns",
    "lab04.fuse_silu": "every spelling of x * sigmoid(x) (function or method, torch.mul, either order), several in one "
    "graph, inside longer products and on a Linear's output",
    "lab04.fuse_silu_no_match": "more look-alikes that must stay as they are: x + sigmoid(x), sigmoid(x) * "
    "sigmoid(x), x * tanh(x), a sigmoid used twice, a sigmoid or mul whose operand is passed "
    "as a keyword, mixed with real matches",
    "lab04.fuse_add_relu": "every spelling of relu(a + b) (torch.add, a.add(b), F.relu, F.relu(a + b, "
    "inplace=True), .relu()), with a number or a Linear's output as an operand",
    "lab04.fuse_add_relu_no_match": "more look-alikes that must stay as they are: relu(a - b), relu(a * b), "
    "sigmoid(a + b), relu(a) + b, torch.relu(input=a + b), mixed with real matches",
    # lab 05
    "lab05.autograd_engine": "a chain of 10,000 nodes, a node the root does not depend on, a root of shape [1, 1], "
    "backward() without a gradient on a root of several elements (ValueError), a share of None, and one input used "
    "by 50 nodes",
    "lab05.elementwise": "size-1 dims stretched on both sides, a missing leading dim with a size-1 dim, 0-d and [1] "
    "operands, float32, and exp of values around ±20",
    "lab05.matmul_reductions": "a weight [d, n] against a batch [B, T, d], batch dims of size 1 stretched and "
    "broadcast both ways, keepdim, negative dims, a 0-d input, and dim=None with keepdim=True",
    "lab05.model_ops": "fully masked rows (more queries than keys), fewer queries than keys, scores and logits of the "
    "order of 10^4, eps larger than mean(x^2), d = 1, one id everywhere, ids of three dims, a single position, three "
    "leading dims, and float32",
    "lab05.adamw_update": "no weight decay, a single step, a large eps, zero gradients, beta1 = 0, resuming at step "
    "1000 with moments already there, and 12 steps",
    "lab05.train_tiny": "the update's edges: no weight decay, a single step, a large eps, zero gradients, beta1 = 0, "
    "and resuming at step 1000",
    "lab05.shard_bounds": "empty tensors, fewer elements than ranks, a single rank, and a billion elements",
    "lab05.ring_sum": "up to 8 ranks and tensors of thousands of elements",
    "lab05.ring_traffic": "up to 8 ranks, 2-D tensors and float64 elements: one chunk per message, whatever W and the "
    "element size",
    "lab05.ring_any_tensor": "a single rank, empty tensors, int64 tensors, strided and permuted views, and 5 ranks",
    "lab05.ddp": "buckets that fit exactly, a weight larger than a bucket, a frozen layer, one parameter per bucket of "
    "the Llama on 3 ranks, three steps, and a parameter the loss never uses (finish() must raise naming it)",
    "lab05.zero_halves": "one rank, fewer elements than ranks, an empty tensor, 5 ranks, float64 and int64 tensors",
    "lab05.zero_step": "no weight decay, a rank with an empty shard, gradients small next to eps, four parameters on "
    "4 ranks",
    # lab 06
    "lab06.rms_norm": "activations of the order of eps, a large eps, vectors far from zero mean, a single channel and "
    "four leading dimensions",
    "lab06.rope": "positions that do not start at 0 (after a cache, a single decode position, seven in random order), "
    "head_dim 2, batches of 2 and 3, and other bases",
    "lab06.llama_tiny": "other shapes: one KV head per query head, 6 query heads over 3 of 16 dimensions with a large "
    "rms_norm_eps and another rope_theta, untied embeddings in one layer, a batch of 3 and a single token",
    "lab06.llama_smollm2": None,
    "lab06.causal_mask_prefill": "masks with a cache: fewer queries than keys, a decode step (t = 1) included",
    "lab06.repeat_kv": None,
    "lab06.cached_attention_prefill": _CACHED_ATTENTION,
    "lab06.cached_attention_decode": _CACHED_ATTENTION,
    "lab06.cached_attention_in_model": "SmolLM2-135M-Instruct's weights in your model answering a question through "
    "your attention",
    "lab06.greedy_decode": "a stop token that ends the answer early, with no model call after the last token, on a "
    "model whose two highest logits tie at every step",
    # lab 07
    "lab07.allocate": "random sequences of calls on pools of 1 to 14 blocks",
    "lab07.free_lru": "random sequences of allocate and free on pools of 1 to 14 blocks, double frees included",
    "lab07.fork": "random sequences of allocate, free and fork on pools of 1 to 14 blocks",
    "lab07.copy_on_write": "random sequences of every operation on pools of 1 to 14 blocks",
    "lab07.pool_in_model": "forked samples of one prompt on the real SmolLM2-135M-Instruct model, through your pool",
    "lab07.forward_step": "plans with blocks of 1 to 5 slots, a pool with a prefix cache (an admission that starts "
    "after its cached blocks) and a pool small enough that the scheduler preempts (a sequence computed again from "
    "position 0)",
    # lab 08
    "lab08.decode_first": "random configurations (1 to 8 running sequences, budgets of 3 to 128 tokens, blocks of 1 "
    "to 16 tokens) and requests that arrive over time",
    "lab08.chunked_prefill": "random budgets and prompt lengths, with chunked prefill on and off, and requests that "
    "arrive over time",
    "lab08.preemption": "random pools of one to two times the blocks of the longest request, some with prefix "
    "caching, and the real engine on pools small enough to force preemptions, where every "
    "request must finish with greedy decoding's tokens",
    "lab08.records": "random budgets with prefix caching, over longer runs",
    "lab08.engine_tiny_model": "prefix caching and whole prompts (chunked prefill off) on the real engine",
    "lab08.engine_loop": "pools small enough to force preemptions (with prefix caching and aborts), and random "
    "configurations, workloads and aborts",
    "lab08.engine_loop_aborts": "pools small enough to force preemptions (with prefix caching and aborts), and random "
    "configurations, workloads and aborts",
    # lab 09
    "lab09.quantize_int8": "group size 1, whole rows of zeros, float64, float16 and bfloat16 weights, invalid "
    "arguments that must raise ValueError (weights holding nan or ±inf, a group_size that is "
    "a bool, zero, negative or a float), and rows as long as SmolLM2's projections with "
    "outlier input channels",
    "lab09.dequantize_int8": "a round trip through quantisation with long rows, group size 1 and all-zero groups, and "
    "scales of the wrong shape, a group size that does not divide the row, or a q that is not "
    "int8, which must raise ValueError",
    "lab09.expected_tokens": "the edges: acceptance rates of 0 and 1 (the int 1 too), gamma = 0, a rate very close "
    "to 1, rates outside [0, 1], a negative gamma, and a result that must be a float",
    "lab09.accept_greedy": None,
    "lab09.accept_distribution": "one-hot drafts under a sampling target, a draft row equal to the target's, tokens "
    "the draft never proposes, gamma = 4, and whether a run seeded through your "
    "generator is reproducible whatever torch's global generator holds",
    "lab09.speculative_greedy": "gamma from 1 to 8, a one-token prompt, and a step cut short by max_new_tokens",
    # lab 10
    "lab10.ttft": _SIMULATED_TRACES,
    "lab10.e2el": _SIMULATED_TRACES,
    "lab10.tpot": _SIMULATED_TRACES,
    "lab10.itl": _SIMULATED_TRACES,
    "lab10.percentile": "about a thousand values, ties, integers, p = 99.9, empty lists and invalid p",
    "lab10.latency_percentiles": "whole traces of the simulated engine, p = 99.9 and 50, a run where nothing "
    "succeeded, one of single-token answers, and an empty run",
    "lab10.goodput": "latencies exactly at their limits, single tokens, a failed fast request, a success without a "
    "chunk, no requests, a duration of zero or below, and a trace of the simulated engine",
    "lab10.diagnose_scenarios": "windows on and just past each rule's threshold, windows where two rules hold at "
    "once, and more seeds of every scenario",
    "lab10.passes_gate": "scores exactly on their limits (16.8 against 16.0 at 5%), nan, infinite and zero scores, "
    "tolerances of 0 and 1, and invalid tolerances and current scores",
    "lab10.canary_verdict": "windows exactly on each limit, failed requests that timed out, a single slow outlier, no "
    "production requests, policies other than the default, and whole simulated rollouts of "
    "every behaviour",
    # lab 12
    "lab12.chunk_text": "texts exactly one window long or ending exactly on a window, one character, a step of one "
    "character, non-ASCII and empty texts, invalid sizes (with an empty text too), and documents of "
    "the shipped corpus",
    "lab12.top_k_cosine": "a 1-D query, k above the number of rows, an all-zero row, zero queries (in a batch "
    "and as one 1-D query), k = 0 (ValueError) and a single row",
    "lab12.recall_at_k": "k beyond every list, a query that retrieved nothing, and invalid inputs",
    "lab12.pipeline": None,
    # lab 13
    "lab13.next_node": "a router that names a node the graph lacks or an answer its mapping lacks, a node "
    "with no outgoing edge, whether each error names the bad value, and a mapped router "
    "exactly at its limit",
    "lab13.call_with_retry": "two retried error types, a fatal error after a retry, a single attempt, and a long run "
    "of failures against the backoff cap, and a predicate retry_on that runs out of attempts",
    "lab13.run_graph": "a loop that outlasts max_steps, runs that need exactly max_steps steps and one step "
    "more, and a node whose retries run out",
    "lab13.run_graph_resume": "a crash at every step of a graph with a flaky node, resumed from SQLite checkpoints "
    "by a new checkpointer",
    # lab 15
    "lab15.softmax_long_rows": "logits near +10^4 and near -10^4, rows that begin with whole blocks of -inf, and "
    "rows with a single finite logit",
    "lab15.softmax_two_passes": None,
    "lab15.flash_odd_shapes": "scores of the order of 10^4, scores near -300 for every visible key, scores that grow "
    "along the keys, tiles with BLOCK_M != BLOCK_N, head_dim 64 with SmolLM2's three "
    "query heads per KV head, and a head dimension that is not contiguous with out a "
    "transposed view whose rows are padded",
    "lab15.flash_traffic": None,
    "lab15.flash_in_tiny_model": "the real SmolLM2-135M-Instruct model reading a short prompt through your kernel "
    "(its logits and first greedy token)",
    "lab15.paged_ragged": "blocks of 6 slots, SmolLM2's 9 query heads over 3 KV heads with head_dim 64 and the "
    "rows of q, out and the caches padded past head_dim (out's by another amount than q's), scores of the order of "
    "10^4, a batch of empty contexts, and the small "
    "random decoder decoding through your kernel",
    "lab15.paged_in_place": None,
    "lab15.gemv_q4_odd_shapes": "the bytes your kernel loads, on one row of x against SmolLM2's 576 inputs in groups "
    "of 64: the packed bytes and scales of its rows once, x once, no float copy of the "
    "weight (counted when Triton runs in its interpreter)",
    # lab 16
    "lab16.model_in_engine": "three requests drawn from the grader's own seed on a pool small enough to preempt, "
    "with other batch limits and budgets",
    "lab16.attention_in_engine": "three requests drawn from the grader's own seed, with other batch limits and budgets",
    "lab16.step_in_engine": "three seeded requests on a pool small enough to preempt and recompute, with other batch "
    "limits and budgets",
    "lab16.loop_in_engine": "three seeded requests on a pool small enough to preempt, two of them aborted in the "
    "middle of the run",
    "lab16.pool_in_engine": "three seeded requests on a pool small enough to preempt, two of them aborted in the "
    "middle "
    "of the run",
    "lab16.scheduler_in_engine": "three seeded requests with other batch limits, budgets and pool sizes",
    "lab16.speculative_answers": "another question, another answer length and another gamma",
    "lab16.engine_answers": "a seeded workload of four requests with preemptions and two aborted requests",
    "lab16.stream_equals_whole": None,
    "lab16.throughput_a_quarter": None,
    "lab16.throughput_half": None,
    # lab 17
    "lab17.router_rules": "random routing on 2 to 5 replicas (slack 0 to 1, memories of 6 and 10 hashes, forgets, "
    "prefixes that part after a few blocks), the options the constructor refuses, one replica and an empty list of "
    "loads",
    "lab17.router_shared_prefix": "a hot prefix shared by every request, where the load bound must keep one replica "
    "from taking them all, and a replica that dies mid-run",
    "lab17.pack_kv": "bfloat16 and float16 stores, every block of a store in shuffled order, and six tables to refuse "
    "with ValueError",
    "lab17.install_kv": "bfloat16 and float16 stores, metadata of another head_dim, block size, layer count or dtype, "
    "a payload cut short, and a pool one block short, each refused with nothing allocated or written",
    "lab17.handoff_in_engines": "longer prompts prefilled in chunks over several steps, in blocks of 3 slots",
    "lab17.tp_mlp": "one rank, one unit per rank, SmolLM2's MLP on 3 ranks, 1537 units on 4, and an x with no leading "
    "dims",
    "lab17.top_k_gating": "k = 1 and k = n_experts, float64 logits, a single token, logits near 10^4, and three inputs "
    "to refuse with ValueError",
    # lab 18
    "lab18.ring_step": "head_dim 1, scores near 10², six blocks in a row, key blocks of 5 and 1 rows against 2 "
    "queries, and a causal_kind to refuse",
    "lab18.ring_forward": "one rank, one position per rank, five ranks, scores near 10² in float32, a non-causal "
    "float64 ring of 3 heads",
    "lab18.ring_traffic": None,
    "lab18.ring_backward": "one rank, one position per rank in float64, a non-causal ring",
    "lab18.resume_exact": "a job killed before its first checkpoint, and a job killed twice, the second time after "
    "it had resumed and saved again",
    "lab18.lora_forward": "float64, rank 1, no bias, the rank equal to the smaller side, an input with no leading "
    "dimension and one with three",
    "lab18.lora_grads": "the same in float64, rank 1, no bias, no leading dimension",
    "lab18.lora_merge": "the float64 layers (restored within 1e-12), and ranks and alphas to refuse",
}

# Visible check id -> the line printed under its ✓ (None in _TEXTS: the cell has no hidden checks).
STILL_CHECKED: dict[str, str] = {
    check_id: NOTHING_HIDDEN if text is None else ALSO_CHECKS + text for check_id, text in _TEXTS.items()
}
