"""Every engine/server option in one frozen dataclass; CLI flags are generated from its fields."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from kernels.backend import KernelBackends
from models.layers.stack import LAYER_WEIGHTS
from models.quantization import ACTIVATION_QUANTIZATION_CHOICES, QUANTIZATION_CHOICES
from runtime.distributed import split_addr
from runtime.mesh import ParallelConfig
from scheduler.scheduler import LOAD_BALANCE_METHODS, SCHEDULE_POLICIES
from scheduler.speculative import SpeculativeConfig


def _opt(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    model: str | None = _opt(None,
                             "HF model directory, .gguf file, or alias (default: smollm2-135m-instruct)")
    tokenizer_path: str | None = _opt(None, "tokenizer directory or .gguf if not the model's own")
    skip_tokenizer_init: bool = _opt(False,
                                     "no tokenizer: token ids in and out only (text fields stay empty)")
    dtype: str = _opt("auto", "auto | float32 | bfloat16 (auto: float32 on CPU, bfloat16 on TPU/GPU)")
    quantization: str | None = _opt(
        None,
        "int4 | int8 | fp8 | auto | none. int4 / int8 / fp8: every Linear layer, the embedding and the LM "
        "head in groups of 32 weights with a float16 scale (int4 also a minimum: GGML's Q4_1 / Q8_0 blocks; "
        "fp8: e4m3 values in int8's layout); MoE expert weights per output channel (int4: in int8). "
        "auto: a GGUF file's own Q4_1 / Q8_0 tensors stay 4- / 8-bit (the same numbers), everything else as "
        "--dtype",
    )
    activation_quantization: str = _opt(
        "none",
        "none | int8 | bf16, with 4- / 8-bit --quantization: each product's input rounded. int8: per "
        "group of 32 (llama.cpp's Q8 activation blocks) and, on a CPU with AVX512-VNNI or AVX2, multiplied "
        "in integers: faster decode steps, prefill and large batches, logprobs off by ~0.01. bf16: to bf16 "
        "with the weights, products summed in f32 (AVX512-BF16 pairs or AMX-BF16 tiles on a CPU; "
        "attention's too over a bf16 KV cache; the rest of the model in --dtype): faster prefill and large "
        "batches, logprobs off as a bfloat16 model's",
    )
    kv_cache_dtype: str = _opt(
        "auto", "auto | float32 | bfloat16: the KV cache's dtype (auto: --dtype). bfloat16 under a float32 "
        "model halves the cache (twice the tokens in the same memory) and the bytes attention reads; "
        "attention still computes in float32")
    kernel_backend: str = _opt(
        "auto", "auto | pallas | reference, then optional per-op overrides, "
        "e.g. 'auto,experts_ffn=reference' "
        "(auto: Pallas kernels where they run natively, the jnp reference elsewhere; "
        "pallas on CPU interprets)"
    )
    layer_weights: str = _opt(
        "auto", "auto | stacked | per_layer: how scanned decoders keep their layers' weights (auto: one "
        "array per layer on CPU, where XLA would copy a slice of stacked weights before each dot; stacked "
        "on TPU/GPU)"
    )
    tp_size: int = _opt(1, "tensor-parallel devices: heads, MLP width and vocabulary split over them")
    dp_size: int = _opt(
        1, "data-parallel ranks, each with its own pages and request slots (max_running_requests, "
        "max_total_tokens and the recurrent slots are per rank); one scheduler batches them all"
    )
    load_balance_method: str = _opt(
        "round_robin", "round_robin | shortest_queue | cache_aware: the data-parallel rank a request is "
        "admitted on (cache_aware: the one whose prefix cache holds most of its prompt, then the least busy)"
    )
    schedule_policy: str = _opt(
        "fcfs", "fcfs | lpm: the order waiting requests are admitted in (lpm: longest cached prefix first, "
        "then arrival; up to 128 waiting, beyond which arrival order)"
    )
    ep_size: int = _opt(1, "expert-parallel devices (divides tp_size): experts split over them")
    nnodes: int = _opt(1, "hosts running one SPMD program (tp_size * dp_size then counts all their devices)")
    node_rank: int = _opt(0, "this host's rank: 0 serves HTTP and schedules, the others follow its steps")
    dist_init_addr: str | None = _opt(
        None, "HOST:PORT of node 0 when nnodes > 1: jax.distributed's coordinator (PORT) and the step "
        "channel to the followers (PORT + 1)"
    )
    page_size: int = _opt(
        16, "tokens per KV page (for a model without attention layers: the prefix cache's unit)")
    max_running_requests: int = _opt(32, "requests decoded together at most (the largest decode bucket)")
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens (overrides mem_fraction_static)")
    mem_fraction_static: float | None = _opt(
        None, "fraction of device memory for weights + KV pool (default 0.85 on TPU/GPU, 0.1 of RAM on CPU)"
    )
    max_recurrent_slots: int | None = _opt(
        None, "recurrent-state slots (SSM / linear-attention models); caps running requests"
    )
    recurrent_state_memory_ratio: float = _opt(
        0.5, "share of the memory budget for recurrent-state slots in hybrid models (the rest is KV)"
    )
    disable_radix_cache: bool = _opt(
        False, "turn the radix prefix cache off: every request computes its whole prompt"
    )
    max_state_snapshots: int | None = _opt(
        None, "prefix-cache snapshots of the recurrent state per data-parallel rank (SSM / linear-attention "
        "models; each as large as a recurrent-state slot; default 4 per running request; 0 turns the prefix "
        "cache off for these models)"
    )
    speculative_algorithm: str | None = _opt(
        None, "speculative decoding: 'ngram' drafts tokens by prompt lookup (the request's own earlier "
        "tokens), 'standalone' by a smaller model with the same tokenizer (--speculative-draft-model-path); "
        "the model verifies them in its decode step (default: off)")
    speculative_num_draft_tokens: int | None = _opt(
        None, "draft tokens verified per request and step, at most; ngram's default: 7 (each step verifies "
        "as many as its measured cost says pay); with --speculative-fixed-drafts, 4 on CPU, where each extra "
        "row of a verify step costs ~30% of a one-row step; standalone's: 4 (each draft token is a step of "
        "the draft model)")
    speculative_draft_model_path: str | None = _opt(
        None, "standalone: the draft model (a path or a name, as --model-path); it must share the model's "
        "tokenizer and have no recurrent layers")
    speculative_num_steps: int | None = _opt(
        None, "standalone: draft model steps per verify step, i.e. draft tokens per request (default: "
        "--speculative-num-draft-tokens)")
    speculative_ngram_max_match_window_size: int = _opt(3, "ngram: longest suffix looked up (tokens)")
    speculative_ngram_min_match_window_size: int = _opt(2, "ngram: shortest suffix looked up (tokens)")
    speculative_fixed_drafts: bool = _opt(
        False, "verify every draft token the decode batch has room for (default: as many as the measured "
        "step times say pay, none where a verify step costs more than its expected tokens)")
    chunked_prefill_size: int | None = _opt(
        None, "prefill tokens per step at most (longer prompts are chunked); default: 256 on CPU, where a "
        "prefill is compute-bound from ~128 tokens and a longer step only stalls the decoding requests, "
        "512 elsewhere")
    prefill_block_size: int = _opt(
        16, "query block of the prefill attention and chunk of the SSD/linear-attention prefill; each "
        "sequence's prefill is padded to it"
    )
    context_length: int | None = _opt(None, "max tokens per request (prompt + output); default: the model's")
    max_queued_requests: int = _opt(4096, "waiting requests at most; more are refused")
    num_continuous_decode_steps: int = _opt(
        1, "decode steps per host round trip when nothing waits (>1: multi-step)")
    disable_overlap_schedule: bool = _opt(
        False, "handle each decode step's tokens before building the next step (default: the next step is "
        "built and dispatched while the previous one runs, as SGLang's overlap schedule)")
    max_top_logprobs: int = _opt(20, "largest top_logprobs_num a request may ask for")
    max_logit_bias: int = _opt(64, "largest number of logit_bias entries per request")
    random_seed: int | None = _opt(None, "seed for requests that give none (default: random)")
    cache_dir: str | None = _opt(None, "models, tokenizers and compiled programs "
                                       "(default: $XLASERVE_CACHE_DIR "
                                       "or the user cache dir)")
    compilation_cache_dir: str | None = _opt(
        None, "JAX persistent compilation cache (default: <cache_dir>/jax)")
    disable_compilation_cache: bool = _opt(False, "do not read or write the persistent compilation cache")
    log_level: str = _opt("info", "info | warning | error")
    host: str = _opt("127.0.0.1", "HTTP host")
    port: int = _opt(30000, "HTTP port")
    api_key: str | None = _opt(
        None, "require `Authorization: Bearer KEY` (default: $XLASERVE_API_KEY if set)")
    served_model_name: str | None = _opt(None, "model name in the API (default: the model argument)")
    chat_template: str | None = _opt(None, "a jinja chat template file used instead of the model's own")
    tool_call_parser: str | None = _opt(
        None, "how the model writes tool calls: hermes (Qwen, Hermes) | smollm2 | llama3 | deepseek_v3 | "
        "deepseek_v31. Default: picked from the chat template; a template without tool support gets the "
        "tools in a system prompt that asks for hermes-style calls")
    reasoning_parser: str | None = _opt(
        None, "deepseek-r1 | qwen3 | kimi | glm45: the model's <think> text goes to reasoning_content, "
        "apart from the answer in content (default: off, the text stays in content)")
    max_request_bytes: int = _opt(8 * 2**20, "largest HTTP request body accepted (larger ones get 413)")
    shutdown_timeout: float = _opt(30.0, "seconds SIGTERM/SIGINT wait for in-flight requests before exiting")

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be auto, float32 or bfloat16")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be auto, float32 or bfloat16")
        KernelBackends.parse(self.kernel_backend)  # raises naming the bad backend or op
        self.parallel  # raises naming the bad size
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            *first, last = LOAD_BALANCE_METHODS
            raise ValueError(f"load_balance_method={self.load_balance_method!r} must be "
                             f"{', '.join(first)} or {last}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            *first, last = SCHEDULE_POLICIES
            raise ValueError(f"schedule_policy={self.schedule_policy!r} must be {', '.join(first)} or {last}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must be >= 1 and node_rank={self.node_rank} in "
                             "[0, nnodes)")
        if self.nnodes > 1:
            if not self.dist_init_addr:
                raise ValueError(f"nnodes={self.nnodes} needs dist_init_addr=HOST:PORT (node 0's address, "
                                 "the same on every node)")
            split_addr(self.dist_init_addr)  # raises naming the bad address
        if self.layer_weights not in LAYER_WEIGHTS:
            raise ValueError(f"layer_weights={self.layer_weights!r} must be one of "
                             f"{', '.join(LAYER_WEIGHTS)}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization={self.quantization!r} must be one of "
                             f"{', '.join(c for c in QUANTIZATION_CHOICES if c)} (or unset)")
        if self.activation_quantization not in ACTIVATION_QUANTIZATION_CHOICES:
            raise ValueError(f"activation_quantization={self.activation_quantization!r} must be none, int8 "
                             "or bf16")
        if self.activation_quantization != "none" and self.quantization in (None, "none"):
            raise ValueError(f"activation_quantization={self.activation_quantization} rounds the inputs of "
                             "4- / 8-bit weights: it needs --quantization int4, int8, fp8 or auto")
        for name in ("page_size", "max_running_requests", "chunked_prefill_size", "prefill_block_size",
                     "max_queued_requests", "num_continuous_decode_steps", "max_top_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_state_snapshots is not None and self.max_state_snapshots < 0:
            raise ValueError(f"max_state_snapshots={self.max_state_snapshots} must be >= 0")
        self.speculative_config()  # raises ValueError naming a bad speculative flag
        from serve.reasoning_parser import reasoning_parser_names
        from serve.tool_parsers import parser_names

        if self.tool_call_parser is not None and self.tool_call_parser not in parser_names():
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} must be one of "
                             f"{', '.join(parser_names())}")
        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning_parser_names():
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} must be one of "
                             f"{', '.join(reasoning_parser_names())}")
        if self.chat_template is not None and not os.path.isfile(os.path.expanduser(self.chat_template)):
            raise ValueError(f"chat_template={self.chat_template!r} is not a file")
        # A chunk that is not whole blocks is refused here, the CPU default too (it divides the others), so
        # the error comes before anything loads.
        self.prefill_chunk("cpu")

    def prefill_chunk(self, backend: str) -> int:
        """Prefill tokens per step on `backend` (`chunked_prefill_size`, or its backend's default); raises
        ValueError unless it is a whole number of prefill blocks."""
        chunk = self.chunked_prefill_size or (256 if backend == "cpu" else 512)
        if chunk % self.prefill_block_size:
            raise ValueError(f"chunked_prefill_size={chunk} must be a multiple of "
                             f"prefill_block_size={self.prefill_block_size}")
        return chunk

    def speculative_config(self, backend: str = "cpu") -> SpeculativeConfig | None:
        """The speculative decoding settings on `backend` (None: off); raises ValueError for bad ones."""
        if self.speculative_algorithm is None:
            if self.speculative_draft_model_path is not None:
                raise ValueError("speculative_draft_model_path needs speculative_algorithm 'standalone'")
            return None
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise ValueError(f"speculative_num_steps={self.speculative_num_steps} must be >= 1")
        for name in ("speculative_num_draft_tokens", "speculative_num_steps"):
            # a request's drafts are verified in the step's decode rows, and every step carries arrays of
            # that many drafts per row: more can never be verified (a huge value only exhausts memory)
            if (value := getattr(self, name)) is not None and value > self.max_running_requests:
                raise ValueError(f"{name}={value} must be at most --max-running-requests "
                                 f"({self.max_running_requests}): drafts are verified in the decode rows")
        algorithm = self.speculative_algorithm.lower()
        steps = self.speculative_num_steps if algorithm == "standalone" else None
        drafts = self.speculative_num_draft_tokens
        if drafts is None:
            weighed = not self.speculative_fixed_drafts
            drafts = 7 if algorithm == "ngram" and (backend != "cpu" or weighed) else 4
        return SpeculativeConfig(algorithm, steps or drafts,
                                 self.speculative_ngram_max_match_window_size,
                                 self.speculative_ngram_min_match_window_size,
                                 self.speculative_draft_model_path, not self.speculative_fixed_drafts)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp_size, dp=self.dp_size, ep=self.ep_size)

    def resolved_cache_dir(self) -> str:
        if self.cache_dir:
            return os.path.expanduser(self.cache_dir)
        if os.environ.get("XLASERVE_CACHE_DIR"):
            return os.environ["XLASERVE_CACHE_DIR"]
        import platformdirs

        return platformdirs.user_cache_dir("xlaserve")

    def resolved_compilation_cache_dir(self) -> str | None:
        if self.disable_compilation_cache:
            return None
        return self.compilation_cache_dir or os.path.join(self.resolved_cache_dir(), "jax")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag-name` per ServerArgs field (use ArgumentDefaultsHelpFormatter to show defaults)."""
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"].replace("%", "%%")  # prose, not a format (argparse expands %)
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(str(f.type), str)
        parser.add_argument(flag, type=kind, default=f.default, help=help_text)


def from_cli(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})
