"""The server of tests/fake_engine.py: a stand-in engine for fast lifecycle and evaluation tests.

Speaks the parts of the OpenAI HTTP surface draftloop uses: /health, /v1/models, /metrics (its own
`fake_spec_*` counters), /v1/chat/completions and streaming /v1/completions. Its greedy "model" is
deterministic in the prompt, so two fake servers agree (lossless) unless --perturb is given.

Modes: ok | fatal (logs a fatal line, then hangs) | exit (dies during start-up) | slow (never ready).
--first-request-delay S: the first completion waits S seconds (a server's warm-up: compilation, caches).
--spec-token-delay-factor F: the speculative server's per-token delay is F times the baseline's.
--reasoning-parser split|inline: chat replies of a thinking model, its reasoning apart or inline.
--load-file PATH: "t0 slope" — other load on the machine growing since t0: every token costs
(1 + slope * (now - t0)) times its delay, on every server reading the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COUNTERS: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": [0.0, 0.0, 0.0]}
WARM = threading.Event()  # set once the first completion has paid --first-request-delay
LOCK = threading.Lock()


def make_handler(args: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    def generate(prompt_ids: list[int], max_tokens: int) -> list[str]:
        # --perturb changes the speculative server's outputs only (a lossy "speculation").
        seed = sum(prompt_ids) + (args.perturb if args.speculative else 0)
        return [f"w{(seed * 31 + i * 7) % 97} " for i in range(max_tokens)]

    def load_factor() -> float:
        if args.load_file is None:
            return 1.0
        with open(args.load_file) as load:
            t0, slope = (float(v) for v in load.read().split())
        return 1.0 + slope * max(0.0, time.time() - t0)

    def observe(num_tokens: int) -> None:
        if not args.speculative:
            return
        k = 3
        with LOCK:
            # Per draft: accept position i with the configured per-position rates.
            drafts = max(1, num_tokens // 2)
            COUNTERS["drafts"] += drafts
            COUNTERS["draft_tokens"] += drafts * k
            for i, rate in enumerate(args.per_pos):
                COUNTERS["per_pos"][i] += drafts * rate
                COUNTERS["accepted"] += drafts * rate

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *a: object) -> None:
            sys.stdout.write("INFO: " + fmt % a + "\n")
            sys.stdout.flush()

        def _json(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {})
            elif self.path == "/v1/models":
                self._json(200, {"data": [{"id": args.served_model_name}]})
            elif self.path == "/metrics":
                with LOCK:
                    lines = ["# HELP fake_requests_running x", "fake_requests_running 0.0"]
                    if args.speculative:
                        lines += [
                            "# TYPE fake_spec_drafts counter",
                            f"fake_spec_drafts {COUNTERS['drafts']}",
                            f"fake_spec_draft_tokens {COUNTERS['draft_tokens']}",
                            f"fake_spec_accepted_tokens {COUNTERS['accepted']}",
                        ]
                        for i, value in enumerate(COUNTERS["per_pos"]):
                            lines.append(f'fake_spec_accepted_per_position{{position="{i}"}} {value}')
                body = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            max_tokens = int(body.get("max_tokens", 16))
            if self.path == "/v1/chat/completions":
                words = generate([len(m["content"]) for m in body["messages"]], max_tokens)
                observe(len(words))
                message = {"role": "assistant", "content": "".join(words)}
                if args.reasoning_parser == "split":  # a thinking model behind a working parser
                    message = {**message, "reasoning_content": "Two plus two is four.", "content": "4"}
                elif args.reasoning_parser == "inline":  # a parser that leaves the thinking in the content
                    message = {**message, "content": "<think>Two plus two is four.</think>4"}
                self._json(200, {"choices": [{"message": message}]})
                return
            if self.path != "/v1/completions":
                self._json(404, {"error": "not found"})
                return
            words = generate(list(body["prompt"]), max_tokens)
            with LOCK:
                cold = not WARM.is_set()
                WARM.set()
            if cold:
                time.sleep(args.first_request_delay)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            delay = args.token_delay * (args.spec_token_delay_factor if args.speculative else 1.0)
            for word in words:
                time.sleep(delay * load_factor())
                chunk = {"choices": [{"index": 0, "text": word}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            observe(len(words))
            final = {"choices": [], "usage": {"completion_tokens": len(words), "prompt_tokens": 1}}
            self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="ok")
    parser.add_argument("--served-model-name", default="target")
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--per-pos", type=float, nargs=3, default=[0.6, 0.4, 0.2])
    parser.add_argument("--perturb", type=int, default=0)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--startup-delay", type=float, default=0.5)
    parser.add_argument("--first-request-delay", type=float, default=0.0)
    parser.add_argument("--spec-token-delay-factor", type=float, default=1.0)
    parser.add_argument("--load-file", default=None)
    parser.add_argument("--reasoning-parser", default=None)  # split | inline: a thinking model's replies
    args = parser.parse_args()
    print("INFO: fake engine starting", flush=True)
    time.sleep(args.startup_delay)
    if args.mode == "fatal":
        print("fake engine refuses the drafter (--mode fatal)", flush=True)
        time.sleep(600)
        return
    if args.mode == "exit":
        print("fake engine: giving up", flush=True)
        sys.exit(3)
    if args.mode == "slow":
        time.sleep(600)
        return
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args))
    print(f"INFO: fake engine listening on {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
