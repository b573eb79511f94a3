"""One vLLM engine of a family member, greedy over the given prompts; prints one JSON line per answer.

    python tests/vllm/driver.py MODEL_FOLDER PROMPTS.json [--connector CONFIG.json]

A script (not in-process) because vLLM's engine spawns processes, which needs a ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("--connector", help="the connector's KVTransferConfig fields, as JSON")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--chat", action="store_true", help="each prompt is a user turn under the chat template")
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(**json.loads(open(args.connector).read())) if args.connector else None
    llm = LLM(model=args.model, max_model_len=args.max_model_len, enforce_eager=True, dtype="float32", kv_transfer_config=kv,
              gpu_memory_utilization=0.5, seed=0)
    prompts = json.loads(open(args.prompts).read())
    # every prompt in one call: the engine schedules them together (concurrent requests over one document)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for out in outputs:
        print("RESULT " + json.dumps({"text": out.outputs[0].text, "ids": list(out.outputs[0].token_ids),
                                      "prompt_tokens": len(out.prompt_token_ids or []),
                                      "cached": out.num_cached_tokens}), flush=True)


if __name__ == "__main__":
    main()
