"""CONTRACT DOUBLE of an SGLang server: the documented `/generate` shape, backed by the real tiny
model through the CPU engine. Real SGLang needs a CUDA GPU and its own environment; this double
lets the client's request/response handling be tested here (ENGINES.md is the contract)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pipeline.logprobs import sequence_logprobs
from rollout_gen.engines.base import SamplingParams
from rollout_gen.engines.cpu import CPUEngine


class SGLangContractDouble:
    def __init__(self, checkpoint: Path) -> None:
        self.engine = CPUEngine(checkpoint)
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep test output quiet
                pass

            def _reply(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply(200, {}) if self.path == "/health" else self._reply(404, {"error": "no route"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with double.lock:
                    double.requests.append({"path": self.path, **body})
                    if self.path == "/generate":
                        self._reply(200, double.generate(body))
                    elif self.path == "/update_weights_from_disk":
                        double.engine.update_weights(Path(body["model_path"]))
                        self._reply(200, {"success": True, "message": "ok"})
                    else:
                        self._reply(404, {"error": "no route"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def generate(self, body: dict) -> list[dict]:
        ids = body["input_ids"]
        sps = body["sampling_params"]
        sps = sps if isinstance(sps, list) else [sps] * len(ids)
        if sps[0]["max_new_tokens"] == 0:
            return [self._score(seq, start) for seq, start in zip(ids, body["logprob_start_len"])]
        params = SamplingParams(sps[0]["max_new_tokens"], sps[0]["temperature"], sps[0]["top_p"],
                                tuple(sps[0]["stop_token_ids"]))
        gens = self.engine.generate(ids, params, [sp.get("sampling_seed", 0) for sp in sps])
        out = []
        for ctx, g in zip(ids, gens):
            finish = {"type": "stop", "matched": g.output_ids[-1]} if g.finish_reason == "stop" else \
                {"type": "length", "length": len(g.output_ids)}
            out.append({"text": "", "output_ids": g.output_ids, "meta_info": {
                "finish_reason": finish, "prompt_tokens": len(ctx), "completion_tokens": len(g.output_ids),
                "cached_tokens": 0, "output_token_logprobs": [[lp, t, None] for lp, t in zip(g.logprobs, g.output_ids)],
            }})
        return out

    def _score(self, seq: list[int], start_len: int) -> dict:
        # chunked over positions like every log-prob in cleaner: real vocabularies fit
        lps = sequence_logprobs(self.engine.model, seq, start=start_len + 1)
        entries = [[None, seq[start_len], None]] + [[lp, seq[k], None] for lp, k in zip(lps, range(start_len + 1, len(seq)))]
        return {"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": entries, "cached_tokens": start_len,
                                                             "finish_reason": {"type": "length", "length": 0}}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
