"""Serving benchmark in the style of SemiAnalysis InferenceX, against any OpenAI-compatible server.

For each ISL/OSL pair (prompt/output tokens) and each concurrency C, C closed-loop clients stream
``/v1/completions`` requests back to back (``ignore_eos`` so every request generates exactly OSL
tokens) and we report, per level:

- output throughput per GPU: generated tokens / wall time / ``--num-gpus``;
- interactivity, tokens/s per user: the median over requests of 1 / TPOT;
- TTFT, ITL (gaps between streamed events), TPOT = (latency - TTFT) / (output tokens - 1) and
  end-to-end latency: mean, p50, p90, p99.

``--hf-baseline`` adds Hugging Face ``transformers`` static-batch ``generate`` on the same machine
at batch sizes equal to the concurrencies (the naive baseline): one batch of C prompts of ISL tokens
prefilled together, then OSL decode steps; TTFT = the prefill time, TPOT = the rest per step.

Results go to ``--out`` as JSON and a PNG plot of throughput per GPU against interactivity.

    # a server that is already running (ours, vLLM, SGLang, ...)
    python bench/serving.py --base-url http://127.0.0.1:8000/v1 --pairs 1024/1024,8192/1024 \
        --concurrency 1,4,16,64
    # the issue's H200 run: start our server for the sweep, stop it, then the HF baseline on the
    # freed GPU, all in one run (the context must hold 8192 + 1024 tokens)
    python bench/serving.py --serve "anneal serve --model random:llama-3.1-8b --device cuda \
            --host 127.0.0.1 --port 8000 --max-model-len 9216 --max-num-seqs 64" \
        --base-url http://127.0.0.1:8000/v1 --pairs 1024/1024,8192/1024 --concurrency 1,4,16,64 \
        --vocab-size 128256 --hf-baseline --hf-model random:llama-3.1-8b --name serving-llama-3.1-8b

Prompts are random token ids by default (exact ISL; the server must accept token-id prompts, as
ours and vLLM do) or random words (``--prompt-mode text``; ISL then approximate, the reported
prompt tokens come from the server's usage). ``--traffic chat`` replaces the fixed pairs by a
workload drawn from a TrafficShape preset or file. Every loop is bounded: a fixed number of
requests per level and a per-level time limit.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = ("the of and to in is was for on that with as by at from his her an it are this be or "
         "which one had not but all were when there can more time into only other new some could "
         "these two may first then do any like my now over such our man me even most made after "
         "also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three").split()
PERCENTILES = (50, 90, 99)


# ---- one request ------------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    latency: float = math.nan
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class Prompt:
    prompt: str | list[int]
    max_tokens: int
    num_tokens: int  # as generated (approximate for text prompts)


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, model: str, prompt: Prompt, extra: dict
) -> RequestResult:
    body = {
        "model": model, "prompt": prompt.prompt, "max_tokens": prompt.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0.0, **extra,
    }
    t0 = time.perf_counter()
    last = None
    res = RequestResult(ok=False, prompt_tokens=prompt.num_tokens)
    events = 0
    try:
        async with client.stream("POST", base_url + "/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens", res.prompt_tokens)
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
                events += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or events
    res.ok = last is not None
    if not res.ok:
        res.error = "the stream carried no tokens"
    return res


# ---- prompts ----------------------------------------------------------------------------------


def make_prompts(isl: int, osl: int, n: int, mode: str, vocab_size: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if mode == "ids":
            hi = min(vocab_size, 30000)
            ids = [rng.randrange(min(10, hi - 1), hi) for _ in range(isl)]
            out.append(Prompt(ids, osl, isl))
        else:
            out.append(Prompt(" ".join(rng.choice(WORDS) for _ in range(isl)), osl, isl))
    return out


def traffic_prompts(spec: str, n: int, seed: int, vocab_size: int, max_model_len: int) -> list[Prompt]:
    from anneal.engine.traffic import load_traffic, make_workload, preset, PRESET_NAMES

    shape = preset(spec) if spec in PRESET_NAMES else load_traffic(spec)
    wl = make_workload(shape, n, seed=seed, vocab_size=vocab_size, max_model_len=max_model_len)
    return [Prompt(r.prompt_token_ids, r.max_tokens, len(r.prompt_token_ids)) for r in wl.requests]


# ---- one concurrency level --------------------------------------------------------------------


async def run_level(
    base_url: str, model: str, prompts: list[Prompt], concurrency: int, extra: dict,
    timeout_s: float,
) -> tuple[list[RequestResult], float]:
    """``concurrency`` closed-loop clients work through ``prompts``; bounded by ``timeout_s``."""
    queue: asyncio.Queue[Prompt] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def worker() -> None:
            while True:
                try:
                    p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await stream_completion(client, base_url, model, p, extra))

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    if pending:
        unfinished = len(prompts) - len(results)
        results += [RequestResult(ok=False, error="level time limit reached")] * unfinished
    return results, duration


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no data."""
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(xs: list[float], scale: float = 1e3) -> dict[str, float]:
    """mean and percentiles, in ms by default."""
    clean = [x for x in xs if not math.isnan(x)]
    out = {"mean": statistics.fmean(clean) * scale if clean else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(clean, q) * scale
    return out


def summarize_level(results: list[RequestResult], duration: float, num_gpus: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [r.tpot for r in ok]
    per_user = [1.0 / t for t in tpots if t > 0 and not math.isnan(t)]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / duration if duration else math.nan,
        "output_throughput_per_gpu": out_tokens / duration / num_gpus if duration else math.nan,
        "total_throughput_per_gpu": (in_tokens + out_tokens) / duration / num_gpus if duration else math.nan,
        "tokens_per_s_per_user": statistics.median(per_user) if per_user else math.nan,
        "ttft_ms": dist([r.ttft for r in ok]),
        "itl_ms": dist([x for r in ok for x in r.itls]),
        "tpot_ms": dist(tpots),
        "e2el_ms": dist([r.latency for r in ok]),
    }


# ---- the Hugging Face static-batch baseline ---------------------------------------------------


def load_hf_model(model: str, device: str) -> tuple[Any, int]:
    """An HF causal LM: a folder, or random weights with a ``random:<preset>``'s real shapes."""
    import torch
    import transformers

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if not model.startswith("random:"):
        m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
        return m, m.config.vocab_size
    from anneal.engine.presets import preset_config

    c = preset_config(model.removeprefix("random:"))
    cfg_cls = transformers.Qwen3Config if c.family == "qwen3" else transformers.LlamaConfig
    cls = transformers.Qwen3ForCausalLM if c.family == "qwen3" else transformers.LlamaForCausalLM
    cfg = cfg_cls(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            m = cls(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    return m, c.vocab_size


class _StepClock:
    """A ``generate`` streamer that timestamps every step (the first call carries the prompt)."""

    def __init__(self, sync: Any):
        self.sync = sync
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_static_generate(
    model: Any, vocab_size: int, isl: int, osl: int, batch: int, seed: int, repeats: int = 1
) -> dict:
    """One static batch of ``batch`` prompts, timed per step inside ``generate``: TTFT = until the
    first generated token (the batch prefill), ITL = time between steps, latency = until the last
    token. Each request of the batch sees the same times; ``repeats`` runs are pooled."""
    import torch

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, min(vocab_size, 30000), (batch, isl), generator=g).to(device)
    mask = torch.ones_like(ids)

    def run(n: int) -> tuple[float, list[float]]:
        clock = _StepClock(sync)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, streamer=clock)
        sync()
        assert out.shape == (batch, isl + n), out.shape
        steps = clock.times[1:]  # the first put is the prompt itself
        assert len(steps) == n, (len(steps), n)
        return t0, steps

    for _ in range(2):
        run(min(osl, 4))  # warm-up (kernels, allocator, caches)
    results = []
    t_all = 0.0
    for _ in range(repeats):
        t0, steps = run(osl)
        t_all += steps[-1] - t0
        itls = [b - a for a, b in zip(steps, steps[1:])]
        results.append(RequestResult(ok=True, prompt_tokens=isl, output_tokens=osl,
                                     ttft=steps[0] - t0, latency=steps[-1] - t0, itls=itls))
    row = summarize_level([r for r in results for _ in range(batch)], t_all, 1)
    row["requests"] = row["completed"] = batch
    row["input_tokens"], row["output_tokens"] = batch * isl, batch * osl
    row["duration_s"] = t_all / repeats  # per run, matching the token counts above
    return row


def run_hf_baseline(args: argparse.Namespace, pairs: list[tuple[int, int]]) -> list[dict]:
    import torch

    model, vocab = load_hf_model(args.hf_model, args.hf_device)
    rows = []
    for isl, osl in pairs:
        for c in args.concurrency:
            n = min(osl, args.hf_osl) if args.hf_osl else osl
            row = {"system": "hf-static", "isl": isl, "osl": osl, "concurrency": c}
            if n != osl:  # fewer steps timed to fit a device budget; per-step rates are what compare
                row["osl_timed"] = n
            try:
                row |= hf_static_generate(model, vocab, isl, n, c, args.seed, args.hf_repeats)
            except torch.OutOfMemoryError as e:
                row |= {"completed": 0, "failed": c, "errors": [f"out of memory: {str(e)[:200]}"]}
                torch.cuda.empty_cache()
            rows.append(row)
            print(_line(row), flush=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


# ---- the sweep --------------------------------------------------------------------------------


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        isl, _, osl = item.strip().partition("/")
        if not (isl.isdigit() and osl.isdigit()) or int(isl) < 1 or int(osl) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: pairs are ISL/OSL, e.g. 1024/1024")
        pairs.append((int(isl), int(osl)))
    return pairs


def parse_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def server_model(base_url: str, model: str | None) -> tuple[str, dict]:
    r = httpx.get(base_url + "/models", timeout=30)
    r.raise_for_status()
    cards = r.json()["data"]
    ids = [c["id"] for c in cards]
    if model is None:
        return ids[0], cards[0]
    if model not in ids:
        raise SystemExit(f"the server serves {ids}, not {model!r}")
    return model, cards[ids.index(model)]


def _line(row: dict) -> str:
    if not row.get("completed"):
        return f"{row['system']:10s} {row['isl']}/{row['osl']} c={row['concurrency']}: failed {row.get('errors')}"
    return (f"{row['system']:10s} {row['isl']:>6}/{row['osl']:<6} c={row['concurrency']:<4} "
            f"{row['output_throughput_per_gpu']:9.1f} tok/s/gpu  {row['tokens_per_s_per_user']:7.1f} tok/s/user  "
            f"TTFT p50 {row['ttft_ms']['p50']:8.1f} ms  TPOT p50 {row['tpot_ms']['p50']:7.2f} ms  "
            f"failed {row['failed']}")


def run_sweep(args: argparse.Namespace, model: str, card: dict) -> list[dict]:
    rows = []
    extra = json.loads(args.extra_body)
    max_len = card.get("max_model_len") or 1 << 20
    sources = [(args.traffic, 0, 0)] if args.traffic else [(f"{i}/{o}", i, o) for i, o in args.pairs]
    for label, isl, osl in sources:
        for c in args.concurrency:
            n = min(max(c * args.requests_per_concurrency, args.min_requests), args.max_requests)
            seed = args.seed + c
            if args.traffic:
                prompts = traffic_prompts(args.traffic, n, seed, args.vocab_size, max_len)
            else:
                if isl + osl > max_len:
                    print(f"skip {label}: beyond the server's max_model_len {max_len}", flush=True)
                    break
                prompts = make_prompts(isl, osl, n, args.prompt_mode, args.vocab_size, seed)
            warm = prompts[:1] if args.warmup else []
            asyncio.run(run_level(args.base_url, model, warm, 1, extra, args.level_timeout))
            results, duration = asyncio.run(
                run_level(args.base_url, model, prompts, c, extra, args.level_timeout)
            )
            row = {"system": args.system, "isl": isl, "osl": osl, "concurrency": c}
            if args.traffic:
                row["traffic"] = label
            row |= summarize_level(results, duration, args.num_gpus)
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("completed") and not math.isnan(r.get("tokens_per_s_per_user", math.nan)):
            series.setdefault((r["system"], r.get("traffic") or f"{r['isl']}/{r['osl']}"), []).append(r)
    for (system, label), pts in sorted(series.items()):
        pts.sort(key=lambda r: r["concurrency"])
        xs = [r["tokens_per_s_per_user"] for r in pts]
        ys = [r["output_throughput_per_gpu"] for r in pts]
        style = "o-" if system != "hf-static" else "s--"
        ax.plot(xs, ys, style, label=f"{system} {label}")
        for x, y, r in zip(xs, ys, pts):
            ax.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("interactivity: tokens/s per user (1 / TPOT, median)")
    ax.set_ylabel("output throughput: tokens/s per GPU")
    ax.set_title(title)
    if series:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finite(obj: Any) -> Any:
    """NaN/inf (no data) become null, so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def environment() -> dict:
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import environment as env  # needs torch

        return env()
    except ImportError:
        return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


class Launched:
    """``--serve``: a server process for the sweep, stopped (SIGTERM) before the HF baseline."""

    def __init__(self, cmd: str, base_url: str, timeout_s: float):
        self.proc = subprocess.Popen(shlex.split(cmd))
        health = base_url.rstrip("/").removesuffix("/v1") + "/health"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"--serve exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"--serve was not ready at {health} after {timeout_s:.0f}s")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    ap.add_argument("--model", help="model id to request (default: the server's first)")
    ap.add_argument("--serve", help="command that starts the server for the sweep (stopped afterwards)")
    ap.add_argument("--serve-timeout", type=float, default=1800, help="seconds to wait for --serve")
    ap.add_argument("--system", default="anneal", help="label of the served system in results")
    ap.add_argument("--pairs", type=parse_pairs, default=parse_pairs("1024/1024,8192/1024"), help="ISL/OSL,...")
    ap.add_argument("--traffic", help="a TrafficShape preset or file instead of --pairs")
    ap.add_argument("--concurrency", type=parse_ints, default=parse_ints("1,4,16,64"))
    ap.add_argument("--requests-per-concurrency", type=int, default=2, help="requests per level = this x C")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=512)
    ap.add_argument("--level-timeout", type=float, default=1800, help="seconds per concurrency level")
    ap.add_argument("--prompt-mode", choices=["ids", "text"], default="ids")
    ap.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("--extra-body", default='{"ignore_eos": true}', help="JSON merged into every request")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--num-gpus", type=int, default=1, help="GPUs the server uses (per-GPU numbers)")
    ap.add_argument("--hf-baseline", action="store_true", help="also run HF static-batch generate")
    ap.add_argument("--hf-only", action="store_true", help="only the HF baseline, no server")
    ap.add_argument("--hf-model", help="HF folder or random:<preset> (default: --model)")
    ap.add_argument("--hf-device", default="cuda")
    ap.add_argument("--hf-osl", type=int, default=None,
                    help="time only this many HF output tokens per pair (rows say osl_timed); its "
                         "per-step cost barely depends on it, and a full 1024 costs minutes per level")
    ap.add_argument("--hf-repeats", type=int, default=1, help="timed runs per HF batch (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="serving", help="result file stem")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows: list[dict] = []
    model = args.model
    card: dict = {}
    if not args.hf_only:
        launched = Launched(args.serve, args.base_url, args.serve_timeout) if args.serve else None
        try:
            model, card = server_model(args.base_url, args.model)
            rows += run_sweep(args, model, card)
        finally:
            if launched is not None:
                launched.stop()
    if args.hf_baseline or args.hf_only:
        args.hf_model = args.hf_model or model
        if not args.hf_model:
            raise SystemExit("--hf-baseline needs --hf-model or --model")
        rows += run_hf_baseline(args, args.pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.name}-{dt.date.today().isoformat()}"
    report = {
        "benchmark": "serving",
        "env": environment(),
        "server": {"base_url": None if args.hf_only else args.base_url, "model": model, "card": card},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "definitions": {
            "output_throughput_per_gpu": "generated tokens / wall time of the level / num_gpus",
            "tokens_per_s_per_user": "median over requests of 1 / TPOT",
            "tpot_ms": "(latency - TTFT) / (output tokens - 1)",
            "itl_ms": "gaps between streamed events",
            "hf-static": "transformers generate, one static batch of size = concurrency, timed per "
                         "step by a streamer; TTFT = the batch prefill",
        },
        "results": rows,
    }
    json_path = args.out / f"{stem}.json"
    json_path.write_text(json.dumps(_finite(report), indent=2, default=str, allow_nan=False))
    png_path = args.out / f"{stem}.png"
    plot(rows, png_path, f"{model}: throughput vs interactivity")
    print(f"wrote {json_path} and {png_path}")
    failed = [r for r in rows if not r.get("completed")]
    return 1 if rows and len(failed) == len(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
