"""One vLLM engine of a family member, greedy over the given prompts; prints one JSON line per answer.

    python tests/vllm/driver.py MODEL_FOLDER PROMPTS.json [--connector CONFIG.json] [--lora NAME=FOLDER ...]

A prompt is a string, or ``{"prompt": ..., "lora": NAME}`` for a request on one of the engine's LoRA adapters.

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
    parser.add_argument("--lora", action="append", default=[], help="NAME=FOLDER: serve this LoRA adapter too")
    parser.add_argument("--sequential", action="store_true",
                        help="one prompt at a time, in order (each sees what the ones before it saved)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.lora.request import LoRARequest

    kv = KVTransferConfig(**json.loads(open(args.connector).read())) if args.connector else None
    loras = {name: LoRARequest(name, i + 1, folder)
             for i, (name, folder) in enumerate(item.split("=", 1) for item in args.lora)}
    lora_options = {"enable_lora": True, "max_lora_rank": 16, "max_loras": len(loras)} if loras else {}
    llm = LLM(model=args.model, max_model_len=args.max_model_len, enforce_eager=True, dtype="float32", kv_transfer_config=kv,
              gpu_memory_utilization=0.5, seed=0, **lora_options)
    items = [p if isinstance(p, dict) else {"prompt": p} for p in json.loads(open(args.prompts).read())]
    prompts = [item["prompt"] for item in items]
    requests = [loras[item["lora"]] if item.get("lora") else None for item in items]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    if args.sequential:
        outputs = [llm.generate([p], params, lora_request=r)[0] for p, r in zip(prompts, requests, strict=True)]
    elif args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        # every prompt in one call: the engine schedules them together (concurrent requests over one document)
        outputs = llm.generate(prompts, params, lora_request=requests if loras else None)
    for out in outputs:
        print("RESULT " + json.dumps({"text": out.outputs[0].text, "ids": list(out.outputs[0].token_ids),
                                      "prompt_tokens": len(out.prompt_token_ids or []),
                                      "cached": out.num_cached_tokens}), flush=True)


if __name__ == "__main__":
    main()
