"""CONTRACT DOUBLE of an SGLang server: the documented `/generate` shape, backed by the real tiny
model through the CPU engine. Real SGLang needs a CUDA GPU and its own environment; this double
lets the client's request/response handling be tested here (SGLang's /generate request and response
fields are the contract).

Like a server, it takes requests concurrently: each handler thread queues its rows and waits, and one
engine thread batches whatever is queued continuously (rows join and leave between decoding steps),
so concurrent clients are really served together. `max_in_flight` records the most rows at once."""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.plain_forward import sequence_logprobs
from pipeline.engines.base import Generation, Request, SamplingParams
from rollout_gen.engines.cpu import CPUEngine


class SGLangContractDouble:
    def __init__(self, checkpoint: Path) -> None:
        self.engine = CPUEngine(checkpoint)
        self.requests: list[dict] = []
        self.lock = threading.Lock()  # the engine: held by a decoding step, a scoring, a weight update
        self.inbox: queue.Queue[tuple[Request, list]] = queue.Queue()
        self.in_flight = self.max_in_flight = 0
        self._stop = threading.Event()
        self.stepper = threading.Thread(target=self._serve, daemon=True)
        self.stepper.start()
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
                if self.path == "/health":
                    self._reply(200, {})
                elif self.path == "/get_model_info":  # SGLang's http_server: the path the server loaded
                    self._reply(200, {"model_path": str(double.engine.checkpoint), "is_generation": True})
                else:
                    self._reply(404, {"error": "no route"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                double.requests.append({"path": self.path, **body})
                if self.path == "/generate":
                    self._reply(200, double.generate(body))
                elif self.path == "/update_weights_from_disk":
                    with double.lock:
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
            with self.lock:
                return [self._score(seq, start) for seq, start in zip(ids, body["logprob_start_len"])]
        params = SamplingParams(
            sps[0]["max_new_tokens"], sps[0]["temperature"], sps[0]["top_p"], tuple(sps[0]["stop_token_ids"])
        )
        waits = []
        for ctx, sp in zip(ids, sps):
            box: list = [threading.Event()]
            self.inbox.put((Request(object(), tuple(ctx), params, sp.get("sampling_seed", 0)), box))
            waits.append(box)
        gens: list[Generation] = []
        for box in waits:
            box[0].wait()
            gens.append(box[1])
        out = []
        for ctx, g in zip(ids, gens):
            finish = (
                {"type": "stop", "matched": g.output_ids[-1]}
                if g.finish_reason == "stop"
                else {"type": "length", "length": len(g.output_ids)}
            )
            out.append(
                {
                    "text": "",
                    "output_ids": g.output_ids,
                    "meta_info": {
                        "finish_reason": finish,
                        "prompt_tokens": len(ctx),
                        "completion_tokens": len(g.output_ids),
                        "cached_tokens": 0,
                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(g.logprobs, g.output_ids)],
                    },
                }
            )
        return out

    def _serve(self) -> None:
        """The engine thread: admit what is queued between decoding steps, answer rows as they finish."""
        boxes: dict[int, list] = {}
        while not self._stop.is_set():
            if not boxes:
                try:
                    item = self.inbox.get(timeout=0.05)
                except queue.Empty:
                    continue
                self.inbox.put(item)
            with self.lock:
                new = []
                while not self.inbox.empty():
                    req, box = self.inbox.get()
                    boxes[id(req)] = box
                    new.append(req)
                self.engine.add(new)
                self.in_flight = len(boxes)
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                for req, gen in self.engine.step():
                    self.engine.release(req.key)
                    box = boxes.pop(id(req))
                    box.append(gen)
                    box[0].set()

    def _score(self, seq: list[int], start_len: int) -> dict:
        # chunked over positions like every log-prob in cleaner: real vocabularies fit
        lps = sequence_logprobs(self.engine.model, seq, start=start_len + 1)
        entries = [[None, seq[start_len], None]] + [
            [lp, seq[k], None] for lp, k in zip(lps, range(start_len + 1, len(seq)))
        ]
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "input_token_logprobs": entries,
                "cached_tokens": start_len,
                "finish_reason": {"type": "length", "length": 0},
            },
        }

    def close(self) -> None:
        self._stop.set()
        self.stepper.join()
        self.server.shutdown()
        self.server.server_close()
