"""The driver of `scripts/gpu_check.sh --sglang` (a connected CUDA machine): the SGLang path, end to end, measured
and reported. (The air-gapped device check, the script's default, is benchmarks/gpu_check.py.)

On a machine with a CUDA GPU it builds an SGLang environment beside the project's (`.venv-sglang`;
SGLang pins its own CUDA torch and transformers, so it cannot share `.venv`), starts an SGLang server on
a checkpoint (default: the one `cleaner init-policy` writes; `--checkpoint` takes any HF directory, `--url`
an SGLang server already running on this machine), and runs two iterations with `rollout.engine=sglang
purify.recompute=sglang`: iteration 0 updates with `train.strategy=local`, iteration 1 with
`train.strategy=deepspeed train.nproc=1` (one rank: NCCL on a GPU, gloo on a CPU). After each update the
new weights are loaded into the server (`/update_weights_from_disk`) and the reload is checked by scoring.
It writes report.json and report.md with:

- the train/inference mismatch: per token, |log-prob SGLang sampled − log-prob the trainer computes| on the
  tokens purification left as they were sampled (the purified sequence equals the lived one up to them),
  with the trainer's own forward (`trainer.chunked_actor.action_log_probs`, the update's first forward,
  on the checkpoint that sampled the iteration), and the same for the tokens SGLang's prefill recomputed;
- tokens/s per GPU of rollout and update, wall time per stage, the card, versions.

`--double` runs the same logic on a CPU machine against the project's SGLang contract double
(tests/sglang_contract_double.py: the CPU engine behind SGLang's /generate contract), started as a server
process of its own; what needs a GPU is then reported as {"not_run": why}, so the report has every field.

Servers it starts listen on 127.0.0.1 only, run in their own process group and die with the driver:
stopped by pid on exit or SIGTERM, and killed by the kernel (PR_SET_PDEATHSIG) if the driver is killed.

The training flow itself (`cleaner train`) is not used: it never reloads an SGLang server's weights after
an update (rollout_gen/stage.py builds an SGLangEngine per rollout without `update_weights`), and the
run's frozen config would refuse the change of train.strategy between the iterations. The driver runs the
flow's three stages in the flow's order instead, and reloads the server itself.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

# At import, not in stats(): the report is finished in a `finally` that SIGTERM can reach while a stage is still
# importing numpy, and a second import of a half-imported numpy fails ("cannot load module more than once"),
# which turned a clean SIGTERM (exit 143) into exit 1
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
REPORT_SCHEMA = 1
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PR_SET_PDEATHSIG = 1
# Sizes for the default checkpoint (`cleaner init-policy`: Qwen3's chat template needs more than the tiny
# world policy's 256 prompt tokens). A real checkpoint takes its own through KEY=VALUE overrides.
DEFAULT_OVERRIDES = ["rollout.max_prompt_tokens=512"]
# Keys the check sets itself: the point of the run is the SGLang path and these two update strategies.
FIXED_KEYS = (
    "storage.root",
    "rollout.policy",
    "rollout.engine",
    "rollout.sglang_url",
    "purify.recompute",
    "train.strategy",
    "train.nproc",
    "train.fresh_optimizer",
)


class CheckError(Exception):
    """Bad input or environment (a missing checkpoint, no GPU, a server that does not answer): one line, exit 2."""


def not_run(why: str) -> dict:
    """A report field that was not measured, with the reason (every field is always present)."""
    return {"not_run": why}


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


# ---- processes ----------------------------------------------------------------------------------


def _die_with(parent: int) -> Callable[[], None]:
    """preexec_fn: the kernel kills the child when the driver dies, however it dies (kill -9 included)."""

    def set_pdeathsig() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the driver died before prctl took effect
            os._exit(1)

    return set_pdeathsig


class Server:
    """A server process this driver started (own process group, bound to the driver's life) or one it was given."""

    def __init__(self, kind: str, url: str, proc: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
        self.kind, self.url, self.proc, self.log_path = kind, url, proc, log_path
        self.url_file: Path | None = None
        self.started_s: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        from pipeline.processes import terminate

        terminate(self.proc.pid, grace=15.0)  # SIGTERM to its group (SGLang stops its own children), then SIGKILL
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def _healthy(url: str) -> bool:
    try:
        return _get(url + "/health")[0] == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _wait_healthy(server: Server, timeout_s: float) -> None:
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc is not None and server.proc.poll() is not None:
            raise CheckError(
                f"the {server.kind} server exited with code {server.proc.returncode} before it answered; "
                f"its log: {server.log_path}"
            )
        if server.url and _healthy(server.url):
            server.started_s = time.perf_counter() - t0
            return
        time.sleep(0.5)
    raise CheckError(
        f"the {server.kind} server did not answer {server.url}/health within {timeout_s:.0f} s "
        f"(--server-timeout); its log: {server.log_path}"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_double(checkpoint: Path, out: Path) -> Server:
    """The contract double as a server process of its own, as a real SGLang server would be; it binds port 0
    itself and writes its URL to `double.url` (wait_ready reads it)."""
    url_file = out / "double.url"
    url_file.unlink(missing_ok=True)
    log_path = out / "server.log"
    with open(log_path, "w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.gpu_check_sglang",
                "--serve-double",
                str(checkpoint),
                "--url-file",
                str(url_file),
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=_die_with(os.getpid()),
        )
    server = Server("contract double", "", proc, log_path)
    server.url_file = url_file
    return server


def launch_sglang(python: Path, checkpoint: Path, out: Path, mem_fraction: float, extra: list[str]) -> Server:
    port = _free_port()
    log_path = out / "server.log"
    cmd = [
        str(python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # the trainer shares the GPU: SGLang would otherwise reserve most of its memory for the KV cache
        "--mem-fraction-static",
        str(mem_fraction),
        "--log-level",
        "warning",
        *extra,
    ]
    log(f"starting SGLang: {' '.join(cmd)} (log {log_path})")
    with open(log_path, "w") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=out,
            start_new_session=True,
            preexec_fn=_die_with(os.getpid()),
        )
    return Server("SGLang", f"http://127.0.0.1:{port}", proc, log_path)


def wait_ready(server: Server, timeout_s: float) -> None:
    """Until the server answers /health, it exits, or the time is up (CheckError: one line, with its log)."""
    deadline = time.monotonic() + timeout_s
    while server.url_file is not None and not server.url_file.is_file():
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise CheckError(f"the {server.kind} did not start (exit {server.proc.poll()}); its log: {server.log_path}")
        time.sleep(0.1)
    if server.url_file is not None:
        server.url = server.url_file.read_text().strip()
    _wait_healthy(server, max(1.0, deadline - time.monotonic()))


def serve_double(checkpoint: Path, url_file: Path) -> int:
    """`--serve-double`: run the contract double until SIGTERM (the driver's stop) or the driver's death."""
    from tests.sglang_contract_double import SGLangContractDouble

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    double = SGLangContractDouble(checkpoint)
    tmp = url_file.with_suffix(".tmp")
    tmp.write_text(double.url)
    tmp.rename(url_file)  # whole or absent: the driver reads it as soon as it exists
    stop.wait()
    double.close()
    return 0


def build_sglang_venv(venv: Path, version: str, base_python: str, wheelhouse: Path | None) -> dict:
    """`venv` with sglang==version, built once (a stamp names the version); returns what was built."""
    stamp = venv / f".gpu-check-sglang-{version}"
    t0 = time.perf_counter()
    if not stamp.is_file():
        log(f"building {venv} with sglang=={version} (its own CUDA torch; several GB, minutes)")
        subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        if wheelhouse is not None:  # a GPU machine without a package index: wheels fetched beforehand
            pip += ["--no-index", "--find-links", str(wheelhouse)]
        done = subprocess.run(pip + [f"sglang=={version}"], capture_output=True, text=True)
        if done.returncode != 0:
            last = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
            raise CheckError(f"pip could not install sglang=={version} into {venv}: {last[0]}")
        stamp.touch()
    out = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import sglang, torch, transformers; print(sglang.__version__, torch.__version__, "
            "torch.version.cuda, transformers.__version__)",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise CheckError(
            f"{venv}: sglang does not import ({(out.stderr.strip().splitlines() or ['?'])[-1]}); "
            f"remove {venv} and rerun"
        )
    sgl, torch_v, cuda, tf = out.stdout.split()
    return {
        "path": str(venv),
        "sglang": sgl,
        "torch": torch_v,
        "cuda": cuda,
        "transformers": tf,
        "wall_s": time.perf_counter() - t0,
    }


# ---- the GPU: card, and which processes used it during a stage ---------------------------------


def nvidia_smi(*query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
    )
    if out.returncode != 0:
        return []
    return [[c.strip() for c in ln.split(",")] for ln in out.stdout.splitlines() if ln.strip()]


class GPUWatch:
    """Samples nvidia-smi during a stage: the most memory any process of this driver's tree held (the
    server's excepted), and the card's memory above what it held when the stage started. The local update
    runs wherever trainer/ puts it; this measures where it ran instead of assuming."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.ours_mib = 0.0
        self.pids_seen = False
        self.base_used = self.peak_used = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def _used() -> float:
        rows = nvidia_smi("--query-gpu=memory.used")
        return sum(float(r[0]) for r in rows) if rows else 0.0

    def _ours(self) -> set[int]:
        import psutil

        me = psutil.Process()
        pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
        if self.server_pid is not None:
            try:
                server = psutil.Process(self.server_pid)
                pids -= {server.pid} | {p.pid for p in server.children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        return pids

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            self.peak_used = max(self.peak_used, self._used())
            apps = nvidia_smi("--query-compute-apps=pid,used_memory")
            self.pids_seen |= bool(apps)
            ours = self._ours()
            for pid, mib in (
                (int(a[0]), float(a[1])) for a in apps if a[0].isdigit() and a[1].replace(".", "").isdigit()
            ):
                if pid in ours:
                    self.ours_mib = max(self.ours_mib, mib)

    def __enter__(self) -> "GPUWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        rise = self.peak_used - self.base_used
        # per process where nvidia-smi can see pids; in a container it often cannot, then the card's rise
        used = self.ours_mib > 0 if self.pids_seen else rise > 256
        return {
            "used_gpu": used,
            "process_peak_mib": self.ours_mib if self.pids_seen else None,
            "card_memory_rise_mib": rise,
            "how": "nvidia-smi per-process memory" if self.pids_seen else "nvidia-smi card memory (no pids visible)",
        }


# ---- the trainer's forward -----------------------------------------------------------------------


class TrainerForward:
    """Log-probs as the update computes them before its first step: the checkpoint loaded as trainer/inputs.py
    loads it, wrapped in OpenRLHF's Actor (trainer.grpo.make_actor), through trainer.chunked_actor."""

    def __init__(self, checkpoint: Path, device: str, dtype: str, temperature: float, pad_id: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from pipeline.config import TrainConfig
        from trainer.grpo import make_actor
        from trainer.inputs import UPDATE_ATTENTION

        self.torch = torch
        self.device, self.pad_id = device, pad_id
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.model = (
            AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype, attn_implementation=UPDATE_ATTENTION)
            .to(device)
            .eval()
        )
        self.actor = make_actor(self.model, TrainConfig(), temperature)

    def logprobs(self, rows: list, batch: int = 8) -> list[list[float]]:
        """log p(response token | everything before it) for every response token of every row."""
        from trainer.batches import TrainingRow, collate
        from trainer.chunked_actor import action_log_probs

        out: list[list[float]] = []
        with self.torch.no_grad():
            for a in range(0, len(rows), batch):
                # every response token in the action mask: its log-prob is wanted whatever the row trains on
                chunk = [
                    TrainingRow(
                        raw_key=str(k),
                        prompt_id=r.prompt_id,
                        sample_idx=r.sample_idx,
                        prompt_ids=list(r.prompt_ids),
                        response_ids=list(r.response_ids),
                        loss_mask=[1] * len(r.response_ids),
                        old_logprobs=[0.0] * len(r.response_ids),
                        advantage=0.0,
                    )
                    for k, r in enumerate(rows[a : a + batch])
                ]
                m = collate(chunk, self.pad_id)
                logp, _ = action_log_probs(
                    self.actor,
                    m.sequences.to(self.device),
                    m.action_mask.to(self.device),
                    m.attention_mask.to(self.device),
                )
                logp = logp.float().cpu()
                for i, r in enumerate(chunk):
                    p, n = len(r.prompt_ids), len(r.response_ids)
                    out.append(logp[i, p - 1 : p - 1 + n].tolist())
        return out

    def close(self) -> None:
        del self.model, self.actor
        if self.device.startswith("cuda"):
            self.torch.cuda.empty_cache()  # the update that follows needs the memory


@contextmanager
def trainer_forward(*args: Any) -> Iterator[TrainerForward]:
    f = TrainerForward(*args)
    try:
        yield f
    finally:
        f.close()


def stats(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "p50": float(np.median(a)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure_mismatch(cfg, run_id: str, iteration: int, fwd: TrainerForward) -> dict:
    """|SGLang − trainer| per loss-masked token of every purified partition, against the trainer's forward.

    Unspliced tokens (logprob_valid = 1): purification found the purified sequence before them equal to the
    context they were sampled in, and kept the log-prob SGLang returned when it sampled them (old_logprobs).
    Recomputed tokens (logprob_valid = 0): a splice changed their context; old_logprobs is SGLang's prefill.
    The trained partition relives the rollout (γ_live, live measure), so where its response equals the raw
    shard's lived one its unspliced old_logprobs must be the raw shard's lived_logprobs: checked
    (`raw_check`), so the figure is the sampler's own number, not something purification wrote."""
    from pipeline.trajectory import purified_from_row, row_key
    from storage.layout import RunLayout
    from storage.schemas import PURIFIED, RAW
    from storage.shards import read_shard
    from trainer.inputs import load_rows

    layout = RunLayout(cfg.storage.root, run_id)
    raw = read_shard(
        layout.raw_dir(iteration),
        RAW,
        columns=["run_id", "iteration", "prompt_id", "sample_idx", "lived_ids", "lived_logprobs"],
    ).to_pylist()
    lived = {row_key(r["run_id"], r["iteration"], r["prompt_id"], r["sample_idx"]): r for r in raw}
    trained = load_rows(cfg, run_id, iteration)[0]
    partitions = []
    for manifest in sorted((layout.iteration_dir(iteration) / "purified").glob("mode=*/*/_MANIFEST.json")):
        part = manifest.parent
        rows = [purified_from_row(r) for r in read_shard(part, PURIFIED).to_pylist()]
        fresh = fwd.logprobs(rows)
        unspliced, recomputed, vs_raw = [], [], []
        for row, lps in zip(rows, fresh):
            src = lived[row.raw_key]
            prefix = _common_prefix(row.response_ids, src["lived_ids"])
            for j, (m, v) in enumerate(zip(row.loss_mask, row.logprob_valid)):
                if m != 1:
                    continue
                (unspliced if v == 1 else recomputed).append(abs(row.old_logprobs[j] - lps[j]))
                if part == trained and v == 1 and j < prefix:
                    vs_raw.append(abs(row.old_logprobs[j] - src["lived_logprobs"][j]))
        partitions.append(
            {
                "partition": str(part.relative_to(layout.iteration_dir(iteration))),
                "rows": len(rows),
                "trained": part == trained,
                "unspliced": stats(unspliced),
                "recomputed": stats(recomputed),
                "_values": (unspliced, recomputed, vs_raw),
            }
        )
    return {"partitions": partitions}


MAX_SLOPE_SE = 0.05  # a moved fraction is read only this sure: 0 (old weights) and 1 (new) are 20 errors apart
MIN_MOVE = 1e-3  # nats at the probe's most moved token: some 1,000× an fp32 log-prob's rounding


def verify_reload(url: str, probe: list, before: list[list[float]], after: list[list[float]]) -> dict:
    """Score the probe on the server and compare with the trainer's forward of the old and the new checkpoint.

    `moved_fraction` is the least-squares slope of (server − old) on (new − old) over the probe's tokens:
    1 when the server serves the new weights, 0 when it still serves the old ones. Precision noise (a bf16
    server against an fp32 trainer) is not correlated with the update's direction, so the slope reads
    through noise larger than the update's own change, where comparing mean distances would not. It cannot
    where the update barely moved the probe: a batch whose groups all scored alike has no advantage to train
    on, its step is at rounding level, and rounding is correlated with such a step (the slope read 0.67–1.02
    over runs at ± 0.03). The reload is then undecided (None), neither verified nor refuted: decided only when
    the slope's standard error is at most MAX_SLOPE_SE and some probe token moved by MIN_MOVE or more."""
    from pipeline.engines.sglang import SGLangEngine

    seqs = [list(r.prompt_ids) + list(r.response_ids) for r in probe]
    served = SGLangEngine(url).score(seqs, [len(r.prompt_ids) for r in probe])
    return reload_verdict(served, before, after)


def reload_verdict(served: list[list[float]], before: list[list[float]], after: list[list[float]]) -> dict:
    """verify_reload's reading of the probe's per-token log-probs: as the server scores them, and as the
    trainer's forward does with the checkpoint before and after the update."""
    triples = [(s, o, n) for ss, os_, ns in zip(served, before, after) for s, o, n in zip(ss, os_, ns)]
    num = sum((s - o) * (n - o) for s, o, n in triples)
    den = sum((n - o) ** 2 for _, o, n in triples)
    moved = None if den == 0.0 else num / den
    slope_se = None
    if moved is not None and len(triples) > 1:
        residual = sum(((s - o) - moved * (n - o)) ** 2 for s, o, n in triples)
        slope_se = math.sqrt(residual / (len(triples) - 1) / den)
    moved_most = max((abs(n - o) for _, o, n in triples), default=0.0)
    decided = slope_se is not None and slope_se <= MAX_SLOPE_SE and moved_most >= MIN_MOVE
    return {
        "probe_tokens": len(triples),
        "server_vs_new": stats([abs(s - n) for s, _, n in triples]),
        "server_vs_old": stats([abs(s - o) for s, o, _ in triples]),
        "new_vs_old_max": moved_most,
        "moved_fraction": moved,
        "slope_se": slope_se,
        "verified": (0.5 < moved < 1.5) if decided else None,
    }


def model_info(url: str) -> dict:
    """SGLang's /model_info (the path of the weights it serves); the double has no such route."""
    try:
        code, body = _get(url + "/model_info", timeout=10)
    except (urllib.error.URLError, OSError) as e:
        return not_run(f"/model_info unreachable ({e})")
    if code != 200:
        return not_run(
            f"/model_info answered HTTP {code} (the contract double implements /generate, /health and "
            "/update_weights_from_disk only)"
        )
    info = json.loads(body)
    return {"model_path": info.get("model_path"), "weight_version": info.get("weight_version")}


def server_version(url: str) -> dict | str:
    try:
        code, body = _get(url + "/server_info", timeout=10)
    except (urllib.error.URLError, OSError) as e:
        return not_run(f"/server_info unreachable ({e})")
    if code != 200:
        return not_run(f"/server_info answered HTTP {code}")
    info = json.loads(body)
    return {
        "version": info.get("version"),
        "dtype": info.get("dtype"),
        "attention_backend": info.get("attention_backend"),
    }


# ---- the run -------------------------------------------------------------------------------------


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "deepspeed", "openrlhf", "apache-beam"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    out["cleaner_commit"] = (
        (git.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")) if git.returncode == 0 else None
    )
    return out


def check_checkpoint_dir(path: Path) -> None:
    if not path.exists():
        raise CheckError(f"checkpoint {path} does not exist")
    if not (path / "config.json").is_file():
        raise CheckError(f"checkpoint {path} has no config.json: expected a Hugging Face model directory")


def check_url(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise CheckError(f"--url {url!r}: expected http://127.0.0.1:PORT")
    if parsed.hostname not in LOOPBACK:
        # the figures are per GPU of this machine: the server must run on it
        raise CheckError(f"--url {url!r}: the server must run on this machine (127.0.0.1); tokens/s per GPU assume it")
    url = url.rstrip("/")
    if not _healthy(url):
        raise CheckError(
            f"SGLang URL {url} does not answer (GET {url}/health failed); start a server there "
            "or leave --url out to have the check start one"
        )
    return url


def cuda_card() -> dict:
    """The GPU this check runs on, or CheckError: no GPU, or a .venv whose torch cannot use it."""
    rows = nvidia_smi("--query-gpu=name,memory.total,driver_version") if shutil.which("nvidia-smi") else []
    if not rows:
        raise CheckError(
            "no CUDA GPU on this machine (nvidia-smi lists none); on a CPU machine run "
            "scripts/gpu_check.sh --sglang --double"
        )
    import torch

    if not torch.cuda.is_available():
        raise CheckError(
            f".venv's torch {torch.__version__} cannot use the GPU ({rows[0][0]}): install torch's CUDA "
            f"build of the same version into .venv (setup.sh takes a CPU wheel where one lies on disk)"
        )
    return {
        "card": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "memory_mib": float(rows[0][1]),
        "driver": rows[0][2],
        "cuda": torch.version.cuda,
    }


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.double = args.double
        self.out = args.out.resolve()
        self.run_id = f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # a fresh run: no stage skips
        self.stages: list[dict] = []
        self.server: Server | None = None
        self.report: dict[str, Any] = {
            "schema": REPORT_SCHEMA,
            "mode": "double" if self.double else "gpu",
            "ok": False,
            "error": None,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": sys.argv[1:],
            "run_id": self.run_id,
            "workspace": str(self.out / "ws"),
            "report": str(self.out / "report.md"),
        }

    # -- bookkeeping ------------------------------------------------------------------------------
    @contextmanager
    def stage(self, name: str, iteration: int | None = None) -> Iterator[dict]:
        entry: dict[str, Any] = {"stage": name, "iteration": iteration, "status": "failed"}
        self.stages.append(entry)
        t0 = time.perf_counter()
        try:
            yield entry
            entry["status"] = "ok"
        finally:
            entry["wall_s"] = time.perf_counter() - t0
            where = "" if iteration is None else f" it {iteration}"
            log(f"{name}{where}: {entry['status']} in {entry['wall_s']:.1f} s")

    def config(self, iteration: int, url: str, checkpoint: Path):
        from pipeline.config import load_config

        user = list(self.args.overrides)
        clash = [o for o in user if o.split("=", 1)[0] in FIXED_KEYS]
        if clash:
            raise CheckError(f"{clash[0]}: set by the check itself ({', '.join(FIXED_KEYS)})")
        fixed = [
            f"storage.root={self.out / 'ws'}",
            f"rollout.policy={checkpoint}",
            "rollout.engine=sglang",
            f"rollout.sglang_url={url}",
            "purify.recompute=sglang",
            f"train.strategy={'local' if iteration == 0 else 'deepspeed'}",
            "train.nproc=1",
        ]
        if iteration == 1:  # checkpoint 1's optimizer state is the local strategy's: DeepSpeed starts its own
            fixed += [f"train.param_dtype={self.args.ds_dtype}", "train.fresh_optimizer=true"]
        return load_config(None, DEFAULT_OVERRIDES + [f"rollout.tasks_per_iteration={self.args.tasks}"] + user + fixed)

    def _check_overrides(self) -> None:
        """The overrides make a valid config (a misspelt key is one line before anything starts)."""
        from pipeline.config import ConfigError

        for i in (0, 1):
            try:
                self.config(i, "http://127.0.0.1:30000", self.args.checkpoint or ROOT / "policies" / "tiny-tool-policy")
            except ConfigError as e:
                raise CheckError(str(e).splitlines()[0]) from None

    # -- the check --------------------------------------------------------------------------------
    def run(self) -> dict:
        t_all = time.perf_counter()
        args, report = self.args, self.report
        # bad input or environment: one line before anything is written or started
        if args.checkpoint is not None:
            check_checkpoint_dir(args.checkpoint)
        url = check_url(args.url) if args.url else None
        self._check_overrides()
        card = None if self.double else cuda_card()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.double:
            report["device"] = {
                "card": not_run("--double: no GPU used"),
                "gpus": 0,
                "memory_mib": not_run("--double"),
                "driver": not_run("--double"),
                "cuda": not_run("--double"),
                "trainer_device": "cpu",
            }
        else:
            report["device"] = {**card, "trainer_device": "cuda"}
        report["versions"] = versions()
        report["sglang_venv"] = (
            not_run("--double: the contract double runs in .venv")
            if self.double
            else not_run("--url: an existing server was used")
            if url
            else None
        )
        try:
            checkpoint = self._checkpoint()
            self._server(checkpoint, url)
            self._iterations(self.server, checkpoint)
            report["ok"] = True
        except CheckError as e:
            report["error"] = str(e)
            raise
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM (main): stop the server, keep the report
            report["error"] = "interrupted"
            raise
        except Exception as e:  # a stage failed: the report says which and how, then one line
            from storage.errors import CleanerError

            failed = next((s for s in reversed(self.stages) if s["status"] == "failed"), None)
            where = (
                "setup"
                if failed is None
                else failed["stage"] + ("" if failed["iteration"] is None else f" (iteration {failed['iteration']})")
            )
            msg = str(e).splitlines()[0] if isinstance(e, CleanerError) else f"{type(e).__name__}: {e}"
            report["error"] = f"{where}: {msg}"
            report["error_detail"] = str(e).splitlines()[-40:]  # e.g. a torchrun rank's traceback
            if os.environ.get("CLEANER_TRACEBACK"):
                raise
        finally:
            if self.server is not None:
                self.server.stop()
                report["server"] = {
                    **self._server_fields(),
                    "stopped": self.server.proc is None or self.server.proc.poll() is not None,
                }
            report["stages"] = self.stages
            report["wall_s"] = {"total": time.perf_counter() - t_all, **self._stage_walls()}
            self._fill_not_run()
            self.write()
        return report

    def _checkpoint(self) -> Path:
        if self.args.checkpoint is not None:
            self.report["checkpoint"] = {"path": str(self.args.checkpoint.resolve()), "made_by": "given (--checkpoint)"}
            return self.args.checkpoint.resolve()
        path = self.out / "policy"
        with self.stage("init_policy"):
            from flows.init_policy import init_policy

            init_policy(path, log=lambda *_: None)  # what `cleaner init-policy --out DIR` writes
        self.report["checkpoint"] = {"path": str(path), "made_by": "cleaner init-policy --out DIR"}
        return path

    def _server(self, checkpoint: Path, url: str | None) -> None:
        """Start (or attach to) the server. It is held in self.server from the moment its process exists, so
        `run`'s finally stops it whatever comes next: a failed start, an error, SIGTERM."""
        args = self.args
        if url:
            self.server = Server("external", url)
        elif self.double:
            with self.stage("server_start"):
                self.server = launch_double(checkpoint, self.out)
                wait_ready(self.server, args.server_timeout)
        else:
            with self.stage("sglang_venv"):
                self.report["sglang_venv"] = build_sglang_venv(
                    args.sglang_venv.resolve(), args.sglang_version, args.venv_python, args.wheelhouse
                )
            with self.stage("server_start"):
                self.server = launch_sglang(
                    args.sglang_venv.resolve() / "bin" / "python",
                    checkpoint,
                    self.out,
                    args.mem_fraction,
                    args.sglang_arg,
                )
                wait_ready(self.server, args.server_timeout)
        self.report["server"] = self._server_fields()
        if url:  # a server we did not start: make it serve the checkpoint this run starts from
            from pipeline.engines.sglang import SGLangEngine

            with self.stage("load_checkpoint"):
                SGLangEngine(url).update_weights(checkpoint)

    def _server_fields(self) -> dict:
        server, fields = self.server, self.report.get("server") or {}
        if "sglang" not in fields:  # asked once, while the server runs
            fields["sglang"] = (
                not_run("--double: the contract double is not SGLang")
                if self.double
                else server_version(server.url)
                if server.url and _healthy(server.url)
                else not_run("the server never answered")
            )
        return {
            **fields,
            "kind": server.kind,
            "url": server.url,
            "pid": server.pid,
            "start_s": server.started_s,
            "log": None if server.log_path is None else str(server.log_path),
        }

    def _iterations(self, server: Server, checkpoint: Path) -> None:
        from pipeline.chat import load_chat
        from pipeline.engines.sglang import SGLangEngine
        from purifier.stage import run_purify_stage
        from rollout_gen.stage import run_rollout_stage
        from storage.checkpoints import DONE_MARKER, checkpoint_for
        from storage.layout import RunLayout
        from storage.schemas import METRICS
        from storage.shards import is_committed, read_manifest, read_shard
        from trainer.inputs import load_rows

        device = "cpu" if self.double else "cuda"
        pad = load_chat(checkpoint).tokenizer.pad_token_id or 0
        iterations = []
        self.report["iterations"] = iterations
        for i in (0, 1):
            cfg = self.config(i, server.url, checkpoint)
            layout = RunLayout(cfg.storage.root, self.run_id)
            it: dict[str, Any] = {"iteration": i, "strategy": cfg.train.strategy}
            iterations.append(it)
            src = checkpoint_for(cfg.storage.root, self.run_id, i, cfg.rollout.policy)
            with self.stage("rollout", i):
                manifest = run_rollout_stage(cfg, self.run_id, i, src, show_progress=False)
            gen, wall = manifest.extra["generated_tokens"], manifest.extra["wall_s"]
            it["rollout"] = {
                "trajectories": manifest.rows,
                "generated_tokens": gen,
                "loop_s": wall,
                "tokens_per_s": gen / wall if wall else None,
            }
            with self.stage("purify", i):
                results = run_purify_stage(cfg, self.run_id, i)
            it["purify"] = {
                "partitions": {
                    f"{r.mode} {'γ' if r.variant.tau is None else 'τ'}={r.threshold:g}": {
                        "rows": r.rows,
                        "dead": r.dead,
                    }
                    for r in results
                }
            }
            # the update's dtype: fp32 for the local strategy, train.param_dtype under DeepSpeed
            dtype = "fp32" if cfg.train.strategy == "local" else cfg.train.param_dtype
            with self.stage("mismatch", i):
                with trainer_forward(src, device, dtype, cfg.rollout.temperature, pad) as fwd:
                    it["mismatch"] = {
                        "checkpoint": str(src),
                        "device": device,
                        "dtype": dtype,
                        **measure_mismatch(cfg, self.run_id, i, fwd),
                    }
                    part = load_rows(cfg, self.run_id, i)[0]
                    probe = self._probe(part)
                    before = fwd.logprobs(probe)
            watch = GPUWatch(server.pid) if not self.double else None
            with self.stage("update", i):
                with watch or _nothing():
                    target = run_update_stage_logged(cfg, self.run_id, i)
            record = json.loads((target / DONE_MARKER).read_text())
            steps = read_shard(layout.metrics_dir(i, "update"), METRICS).to_pylist()
            tokens = int(sum(r["value"] for r in steps if r["name"] == "tokens"))
            loop = record.get("wall_s")
            it["update"] = {
                "strategy": cfg.train.strategy,
                "ranks": record.get("ranks", 1),
                # trainer/deepspeed_update.py: gloo where torch has no CUDA, else OpenRLHF's NCCL set-up
                "backend": None if cfg.train.strategy == "local" else ("gloo" if self.double else "nccl"),
                "param_dtype": dtype,
                "steps": len({r["step"] for r in steps}),
                "trained_tokens": tokens,
                "loop_s": loop,
                "tokens_per_s": tokens / loop if loop else None,
                "gpu": not_run("--double: no GPU") if watch is None else watch.result(),
            }
            if cfg.train.strategy == "deepspeed" and i > 0:
                it["update"]["note"] = (
                    "optimizer state starts fresh: the checkpoint it continues from was written by the "
                    "local strategy (trainer_state.pt, not deepspeed/)"
                )
            with self.stage("reload", i):
                SGLangEngine(server.url).update_weights(target)
            with self.stage("reload_check", i):
                with trainer_forward(target, device, dtype, cfg.rollout.temperature, pad) as fwd:
                    after = fwd.logprobs(probe)
                it["reload"] = {
                    "checkpoint": str(target),
                    "model_info": model_info(server.url),
                    **verify_reload(server.url, probe, before, after),
                }
                it["reload"]["wall_s"] = next(
                    s["wall_s"] for s in self.stages if s["stage"] == "reload" and s["iteration"] == i
                )
            it["committed"] = {
                "raw": is_committed(layout.raw_dir(i)),
                "purified": all(
                    is_committed(p.parent)
                    for p in (layout.iteration_dir(i) / "purified").glob("mode=*/*/_MANIFEST.json")
                ),
                "checkpoint": (target / DONE_MARKER).is_file(),
                "raw_manifest_rows": read_manifest(layout.raw_dir(i)).rows,
            }

    def _probe(self, part: Path) -> list:
        """A few trained rows, cut to 64 response tokens: what the reload check scores on the server."""
        from pipeline.trajectory import purified_from_row
        from storage.schemas import PURIFIED
        from storage.shards import read_shard

        rows = [purified_from_row(r) for r in read_shard(part, PURIFIED).to_pylist()[:4]]
        for r in rows:
            r.response_ids, r.loss_mask = r.response_ids[:64], r.loss_mask[:64]
        return [r for r in rows if r.response_ids]

    # -- the report -------------------------------------------------------------------------------
    def _stage_walls(self) -> dict:
        walls: dict[str, float] = {}
        for s in self.stages:
            walls[s["stage"]] = walls.get(s["stage"], 0.0) + s["wall_s"]
        return walls

    def _fill_not_run(self) -> None:
        """Totals over both iterations; every field present, those not measured as {"not_run": why}."""
        r = self.report
        its = r.setdefault("iterations", [])
        why_failed = f"not reached: {r['error']}" if r["error"] else None
        for key in ("device", "versions", "checkpoint", "server"):
            r.setdefault(key, not_run(why_failed or "not reached"))
        if r.get("sglang_venv") is None:
            r["sglang_venv"] = not_run(why_failed or "not reached")
        unspliced, recomputed, vs_raw = [], [], []
        for it in its:
            for p in it.get("mismatch", {}).get("partitions", []):
                u, c, raw = p.pop("_values")
                if p["trained"]:  # the other partitions hold mostly the same tokens again
                    unspliced += u
                    vs_raw += raw
                recomputed += c
        r["mismatch"] = {
            "unspliced": stats(unspliced),
            "recomputed": stats(recomputed),
            "raw_check": {"tokens": len(vs_raw), "max_abs_diff": max(vs_raw, default=None)},
            "what": (
                "|log-prob from SGLang − log-prob of the trainer's forward| per loss-masked token, in nats, both "
                "iterations; unspliced: tokens of the trained partition whose context is the one SGLang sampled "
                "them in (its sampling log-prob, equal to the raw shard's: raw_check); recomputed: tokens whose "
                "context a splice changed, scored by SGLang's prefill (logprob_start_len), every partition"
            ),
        }
        per_gpu_why = "--double: measured on the CPU (tokens_per_s), no GPU"
        roll = [it["rollout"] for it in its if "rollout" in it]
        gen, loop = sum(x["generated_tokens"] for x in roll), sum(x["loop_s"] for x in roll)
        r["rollout"] = {
            "generated_tokens": gen,
            "loop_s": loop,
            "tokens_per_s": gen / loop if loop else None,
            # one server on one GPU generates: per GPU is the server's rate
            "tokens_per_s_per_gpu": not_run(per_gpu_why) if self.double else (gen / loop if loop else None),
        }
        r["update"] = {}
        for it in its:
            u = it.get("update")
            if u is None:
                continue
            per_gpu: Any = not_run(per_gpu_why)
            if not self.double:
                on_gpu = u["gpu"].get("used_gpu")
                per_gpu = (
                    (u["tokens_per_s"] / u["ranks"])
                    if on_gpu and u["tokens_per_s"]
                    else not_run("the update did not use the GPU (see gpu): trainer/ ran it on the CPU")
                )
            r["update"][u["strategy"]] = {**u, "tokens_per_s_per_gpu": per_gpu}
        for strategy in ("local", "deepspeed"):
            r["update"].setdefault(strategy, not_run(why_failed or "not reached"))
        r["committed_iterations"] = sum(
            1 for it in its if all(v for k, v in it.get("committed", {"x": False}).items() if k != "raw_manifest_rows")
        )
        r["reload_verified"] = [it.get("reload", {}).get("verified") for it in its]

    def write(self) -> None:
        from storage.shards import atomic_write_json

        atomic_write_json(self.out / "report.json", self.report)
        (self.out / "report.md").write_text(render_markdown(self.report))
        log(f"report: {self.out / 'report.json'} and {self.out / 'report.md'}")


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def run_update_stage_logged(cfg, run_id: str, iteration: int) -> Path:
    from trainer.stage import run_update_stage

    return run_update_stage(cfg, run_id, iteration, log=lambda line: log(str(line)))


# ---- markdown ------------------------------------------------------------------------------------


def _v(x: Any, fmt: str = "{:.4g}") -> str:
    if isinstance(x, dict) and "not_run" in x:
        return f"not run ({x['not_run']})"
    if x is None:
        return "—"
    if isinstance(x, float):
        return fmt.format(x) if math.isfinite(x) else str(x)
    return str(x)


def render_markdown(r: dict) -> str:
    dev, srv = r.get("device", {}), r.get("server") or {}
    sgl = srv.get("sglang") or not_run("not reached")
    lines = [
        f"# GPU check ({r['mode']}) — {r['when']}",
        "",
        f"Result: **{'ok' if r['ok'] else 'FAILED: ' + str(r['error'])}** · run `{r['run_id']}` in `{r['workspace']}`",
        "",
        f"Card: {_v(dev.get('card'))} · driver {_v(dev.get('driver'))} · CUDA {_v(dev.get('cuda'))}",
        "",
    ]
    v = r.get("versions", {})
    if "not_run" not in v:
        lines += ["Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()), ""]
    lines += [
        f"SGLang environment: {_v(r.get('sglang_venv'))}",
        "",
        f"Server: {_v(srv.get('kind'))} at {_v(srv.get('url'))}, SGLang "
        + (_v(sgl) if "not_run" in sgl else ", ".join(f"{k} {v}" for k, v in sgl.items())),
        "",
        "## Train/inference mismatch (nats per token)",
        "",
        "| tokens | count | mean | p50 | p99 | max |",
        "|---|---|---|---|---|---|",
    ]
    m = r["mismatch"]
    for name in ("unspliced", "recomputed"):
        s = m[name]
        lines.append(f"| {name} | {s['count']} | {_v(s['mean'])} | {_v(s['p50'])} | {_v(s['p99'])} | {_v(s['max'])} |")
    lines += [
        "",
        m["what"] + f". Sampled log-probs in the purified vs the raw shard, {m['raw_check']['tokens']} "
        f"tokens: max |Δ| {_v(m['raw_check']['max_abs_diff'])}.",
        "",
        "## Throughput",
        "",
        "| stage | tokens | loop s | tokens/s | tokens/s per GPU |",
        "|---|---|---|---|---|",
    ]
    ro = r["rollout"]
    lines.append(
        f"| rollout (generated) | {ro['generated_tokens']} | {_v(ro['loop_s'])} | {_v(ro['tokens_per_s'])} | "
        f"{_v(ro['tokens_per_s_per_gpu'])} |"
    )
    for strategy, u in r["update"].items():
        if "not_run" in u:
            lines.append(f"| update {strategy} | {_v(u)} | | | |")
            continue
        lines.append(
            f"| update {strategy} ({u['param_dtype']}{', ' + u['backend'] if u['backend'] else ''}; trained) | "
            f"{u['trained_tokens']} | {_v(u['loop_s'])} | {_v(u['tokens_per_s'])} | {_v(u['tokens_per_s_per_gpu'])} |"
        )
    lines += [
        "",
        "## Weight reloads",
        "",
        "Scored on the server after each reload against the trainer's forward of the "
        "checkpoint before and after the update; moved fraction 1 = the server serves the new weights, 0 = the old "
        f"(± its standard error; verified None: an update too small to tell, no token moved {MIN_MOVE} nats or "
        f"an error over {MAX_SLOPE_SE}).",
        "",
        "| iteration | checkpoint | wall s | server vs new (mean) | server vs old (mean) | moved fraction | "
        "verified | server's model_path |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for it in r.get("iterations", []):
        rl = it.get("reload")
        if rl:
            lines.append(
                f"| {it['iteration']} | `{Path(rl['checkpoint']).name}` | {_v(rl['wall_s'])} | "
                f"{_v(rl['server_vs_new']['mean'])} | {_v(rl['server_vs_old']['mean'])} | "
                f"{_v(rl['moved_fraction'])} ± {_v(rl.get('slope_se'))} | {_v(rl['verified'])} | "
                f"{_v(rl['model_info'].get('model_path', rl['model_info']))} |"
            )
    lines += ["", "## Wall time per stage (s)", "", "| stage | iteration | status | wall s |", "|---|---|---|---|"]
    for s in r.get("stages", []):
        lines.append(
            f"| {s['stage']} | {'' if s['iteration'] is None else s['iteration']} | {s['status']} | {s['wall_s']:.2f} |"
        )
    lines += ["", f"Total: {r['wall_s']['total']:.1f} s. Committed iterations: {r['committed_iterations']}.", ""]
    return "\n".join(lines)


# ---- RESULTS.md --------------------------------------------------------------------------------


def record_results(r: dict) -> None:
    """The `gpu` section of benchmarks/RESULTS.md from a GPU run's report (benchmarks.common.record)."""
    from benchmarks.common import BenchResult, Row, record

    m, ro = r["mismatch"], r["rollout"]
    rows = [
        Row(f"mismatch {kind} tokens {k}", m[kind][k], unit="nats", higher_is_better=False)
        for kind in ("unspliced", "recomputed")
        for k in ("mean", "p99", "max")
        if m[kind][k] is not None
    ]
    if isinstance(ro["tokens_per_s_per_gpu"], float):
        rows.append(Row("rollout tokens/s per GPU", ro["tokens_per_s_per_gpu"], unit="tokens/s"))
    for strategy, u in r["update"].items():
        if isinstance(u.get("tokens_per_s_per_gpu"), float):
            rows.append(Row(f"update {strategy} tokens/s per GPU", u["tokens_per_s_per_gpu"], unit="tokens/s"))
    for stage, wall in r["wall_s"].items():
        rows.append(Row(f"wall {stage}", wall, unit="s", higher_is_better=False))
    dev, sv = r["device"], r["server"].get("sglang", {})
    record(
        BenchResult(
            "gpu",
            f"`scripts/gpu_check.sh --sglang` on {dev['card']} (driver {dev['driver']}, CUDA {dev['cuda']}), "
            f"SGLang {sv.get('version') if isinstance(sv, dict) else '?'}: two iterations with "
            "rollout.engine=sglang purify.recompute=sglang, update local then DeepSpeed (one rank, NCCL).",
            rows,
            notes=[
                f"checkpoint: {r['checkpoint']['path']} ({r['checkpoint']['made_by']}); overrides "
                f"{' '.join(a for a in r['command'] if '=' in a and not a.startswith('-')) or 'none'}; "
                f"report {r['report']}",
                f"mismatch tokens: {m['unspliced']['count']} unspliced, {m['recomputed']['count']} "
                f"recomputed; {m['what']}",
                f"reloads verified by scoring (moved fraction ≈ 1): {r['reload_verified']}",
            ]
            + [
                f"update {s}: {'on the GPU' if u['gpu'].get('used_gpu') else '**not on the GPU**'} "
                f"({u['gpu'].get('how')}), {u['trained_tokens']} trained tokens in {u['loop_s']:.1f} s"
                for s, u in r["update"].items()
                if "gpu" in u
            ],
        )
    )


# ---- entry point ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other refusal of the check
        raise CheckError(f"{message} (scripts/gpu_check.sh --sglang --help)")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(
        prog="scripts/gpu_check.sh --sglang",
        description="Run the GPU path (SGLang rollouts and recompute, weight reloads, local and DeepSpeed updates) "
        "for two iterations and write report.json + report.md. --double: the same on a CPU machine against the "
        "project's SGLang contract double.",
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides (pipeline/config.py), e.g. rollout.max_turn_tokens=2048 for a real checkpoint",
    )
    ap.add_argument("--double", action="store_true", help="no GPU: serve the contract double instead of SGLang")
    ap.add_argument(
        "--checkpoint", type=Path, help="HF checkpoint directory (default: one `cleaner init-policy` makes)"
    )
    ap.add_argument(
        "--url",
        help="an SGLang server already running on this machine (http://127.0.0.1:PORT); "
        "its weights are replaced by the checkpoint's",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "workspace" / "gpu-check", help="report and workspace folder")
    ap.add_argument("--tasks", type=int, default=8, help="rollout.tasks_per_iteration (default 8)")
    ap.add_argument(
        "--ds-dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="train.param_dtype of the DeepSpeed update (default: bf16 on a GPU, fp32 with --double)",
    )
    ap.add_argument("--sglang-version", default=os.environ.get("SGLANG_VERSION", ""), help=argparse.SUPPRESS)
    ap.add_argument("--sglang-venv", type=Path, default=ROOT / ".venv-sglang", help="where the SGLang venv is built")
    ap.add_argument("--venv-python", default=os.environ.get("PYTHON", "python3"), help=argparse.SUPPRESS)
    ap.add_argument("--wheelhouse", type=Path, help="install SGLang from this folder of wheels (no package index)")
    ap.add_argument(
        "--mem-fraction",
        type=float,
        default=0.35,
        help="SGLang --mem-fraction-static (default 0.35: the trainer shares the GPU)",
    )
    ap.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        help="one more argument for sglang.launch_server, "
        "written --sglang-arg=--attention-backend --sglang-arg=torch_native (e.g. where SGLang's default "
        "kernels refuse the init-policy model's head_dim of 16)",
    )
    ap.add_argument(
        "--server-timeout", type=float, default=None, help="seconds to wait for the server (default 900, --double 120)"
    )
    ap.add_argument("--record", action="store_true", help="write the report into benchmarks/RESULTS.md (`gpu`)")
    ap.add_argument("--serve-double", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--url-file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ds_dtype is None:
        args.ds_dtype = "fp32" if args.double else "bf16"
    if args.server_timeout is None:
        args.server_timeout = 120.0 if args.double else 900.0
    if args.tasks < 1:
        raise CheckError(f"--tasks {args.tasks}: at least 1")
    if not 0 < args.mem_fraction < 1:
        raise CheckError(f"--mem-fraction {args.mem_fraction}: a fraction of the GPU's memory, between 0 and 1")
    if args.record and args.double:
        raise CheckError("--record writes the GPU figures into benchmarks/RESULTS.md; a --double run has none")
    if not args.double and not args.url and not args.sglang_version:
        raise CheckError("no SGLang version to install: run through scripts/gpu_check.sh (it pins one)")
    return args


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
        if args.serve_double:
            return serve_double(args.serve_double, args.url_file)
        # SIGTERM ends the run through `finally`, so the server it started is stopped by pid
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        report = Check(args).run()
    except CheckError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpu_check: interrupted; the servers it started are stopped", file=sys.stderr)
        return 130
    if not report["ok"]:
        print(f"gpu_check: {report['error']} (report: {args.out / 'report.md'})", file=sys.stderr)
        return 1
    if args.record:
        record_results(report)
        log("wrote the gpu section of benchmarks/RESULTS.md")
    m = report["mismatch"]["unspliced"]
    log(
        f"ok: mismatch on {m['count']} unspliced tokens mean {_v(m['mean'])} p99 {_v(m['p99'])} max {_v(m['max'])}; "
        f"{report['committed_iterations']} iterations committed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
