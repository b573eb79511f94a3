"""Talk to `orchestra serve` with the official `openai` client: one conversation, two family members, one prefill.

    orchestra serve --port 8000 &                   # the bundled family, OpenAI-compatible
    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--document FILE]

A document goes in the system message; the root answers a question about it; the follow-up goes to the
fine-tuned member. The server prefilled the document once, on the root: the fine-tuned member gets the
root's KV cache mapped into it (gated; re-prefilled if a gate says no), and the response headers say so.
With `orchestra serve --api-key-env NAME`, export the same key as OPENAI_API_KEY.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from openai import OpenAI


def default_document() -> str:
    from orchestra.family.corpus import data_text  # a bundled licence text, ~2k tokens

    return data_text("apache-2.0.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--document", type=Path, help="a text file (default: the Apache-2.0 licence)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    document = args.document.read_text(encoding="utf-8") if args.document else default_document()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    messages = [
        {"role": "system", "content": f"Answer questions about this document, briefly.\n\n{document}"},
        {"role": "user", "content": "What does this document allow me to do?"},
    ]

    # 1. a question on the root, streamed
    print("root: ", end="", flush=True)
    reply = []
    for chunk in client.chat.completions.create(model="root", messages=messages, max_tokens=args.max_tokens,
                                                temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            reply.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    # 2. the follow-up on the fine-tuned member; with_raw_response gives the headers as well
    messages += [{"role": "assistant", "content": "".join(reply)},
                 {"role": "user", "content": "What must I keep when I redistribute it?"}]
    raw = client.chat.completions.with_raw_response.create(model="finetuned", messages=messages,
                                                           max_tokens=args.max_tokens, temperature=0)
    completion = raw.parse()
    print(f"finetuned: {completion.choices[0].message.content}")
    usage = completion.usage
    print(f"\ncache: {raw.headers.get('x-orchestra-cache')} "
          f"(source {raw.headers.get('x-orchestra-cache-source', '-')}, gates {raw.headers.get('x-orchestra-gates', '-')})")
    print(f"prompt tokens {usage.prompt_tokens}, of which cached (not recomputed) "
          f"{usage.prompt_tokens_details.cached_tokens}")


if __name__ == "__main__":
    main()
