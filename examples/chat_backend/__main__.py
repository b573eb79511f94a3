"""`python -m examples.chat_backend`: serve the chat backend with uvicorn."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.chat_backend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--home", type=Path, default=None, help="family home (default: $ORCHESTRA_HOME)")
    parser.add_argument("--device", default=None, help="cpu, cuda:N or auto (default: auto)")
    parser.add_argument("--source", default=None, help="member that prefills documents (default: root)")
    parser.add_argument("--on-missing-mapping", choices=["refuse", "calibrate"], default=None,
                        help="re-prefill when a pair has no mapping (refuse, default) or calibrate it in the request")
    args = parser.parse_args(argv)

    import uvicorn

    from examples.chat_backend.app import create_app
    from examples.chat_backend.config import ChatConfig

    config = ChatConfig.from_env()
    overrides = {"home": args.home, "device": args.device, "source": args.source,
                 "on_missing_mapping": args.on_missing_mapping}
    config = config.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    uvicorn.run(create_app(config), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
