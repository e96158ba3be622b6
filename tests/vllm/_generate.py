"""Child process of tests/vllm/engine.py: one vLLM engine, greedy tokens for the given prompts, printed."""

from __future__ import annotations

import json
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        load_format=spec["load_format"],
        model_loader_extra_config=spec["extra"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        # The KV cache's size, not a fraction of the machine's memory: vLLM's CPU backend takes the fraction
        # of the NUMA node's memory, less the process's RSS, and the process maps the segment, so on a node of
        # 12 GiB 5% left a negative cache and the engine refused to start.
        kv_cache_memory_bytes=256 << 20,
        max_model_len=256,
        seed=0,
    )
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
