"""Closed-loop serving client for vLLM's OpenAI-compatible server (issue 5, paper Figure 5).

    python3 benchmarks/serve_bench.py --url http://127.0.0.1:8000 --set A --concurrency 16 \
        [--output-tokens 1024] [--offset K --limit N] [--out $OUT/serve.json]

Prompts are random token ids (the server runs with ``--skip-tokenizer-init``): set A has 256
prompts of 4k-64k tokens, set B 64 prompts of 64k-126k (lengths uniform in log length, fixed
seed). ``--concurrency`` workers each send one streaming ``/v1/completions`` request at a time
(``ignore_eos``, greedy) until the set is done. Per request: time to first token and TPOT =
(last chunk - first chunk) / (tokens - 1); overall: median TPOT, output tokens per second of
wall time, and whether every request completed with all its tokens. Standard library only.

``--offset K --limit N`` runs prompts K..K+N-1 of the set (the same prompts as in a whole run):
a set too long for one sitting is run in slices, each against a fresh server, and
``serve_report.py`` pools the slices' per-request records (every slice's ramp-up and drain is
then in the totals, for every arm alike).
"""

import argparse
import http.client
import json
import math
import os
import random
import statistics
import sys
import threading
import time
import urllib.parse

SETS = {"A": (256, 4096, 65536), "B": (64, 65536, 126976)}


def prompt_lengths(name, seed=0):
    count, low, high = SETS[name]
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(count)]


def stream_completion(url, model, prompt, max_tokens, timeout=3600):
    """Send one streaming request; returns (first token time, last token time, tokens, ok)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                           ignore_eos=True, stream=True,
                           stream_options=dict(include_usage=True)))
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        return dict(start=start, ok=False, error=f"HTTP {response.status}: "
                    f"{response.read()[:300].decode(errors='replace')}")
    first = last = None
    chunks = 0
    usage = None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"]
        if event.get("choices"):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            chunks += 1
    connection.close()
    tokens = usage["completion_tokens"] if usage else chunks
    return dict(start=start, first=first, last=last, tokens=tokens, chunks=chunks,
                ok=tokens == max_tokens)


def tpot_ms(first, last, tokens):
    """Time per output token after the first, in ms, from the first and last tokens' times in
    seconds (vLLM's definition; ``vllm_tpot.py`` uses it too)."""
    return (last - first) / (tokens - 1) * 1e3


def set_prompts(name, offset=0, limit=0, seed=0):
    """Prompts ``offset .. offset + limit - 1`` (all from ``offset`` if ``limit`` is 0) of a
    set, as token-id lists; each prompt is the same whatever the slice."""
    lengths = prompt_lengths(name, seed)
    end = len(lengths) if not limit else min(len(lengths), offset + limit)
    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths[:end]]
    return prompts[offset:]


def run(url, model, prompts, concurrency, max_tokens, deadline_s=None):
    """Send ``prompts`` from ``concurrency`` closed-loop workers. With ``deadline_s``, no
    request is sent once that many seconds have passed (those in flight finish): the run
    covers the first N prompts, N = ``requests``, and always ends with a result, where a
    timeout around the client would lose the slice."""
    lengths = [len(prompt) for prompt in prompts]
    queue = list(range(len(prompts)))
    lock = threading.Lock()
    records = [None] * len(prompts)

    def worker():
        while True:
            with lock:
                if not queue or (deadline_s is not None
                                 and time.perf_counter() - start > deadline_s):
                    return
                index = queue.pop(0)
            try:
                records[index] = stream_completion(url, model, prompts[index], max_tokens)
            except Exception as error:  # noqa: BLE001 -- a failed request is a result
                records[index] = dict(ok=False, error=f"{type(error).__name__}: {error}")
            records[index]["prompt_tokens"] = lengths[index]

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    records = records[:len(prompts) - len(queue)]  # the prompts sent: the first N, in order
    done = [r for r in records if r and r.get("ok")]
    tpots = [tpot_ms(r["first"], r["last"], r["tokens"]) for r in done
             if r["tokens"] > 1 and r["chunks"] > 1]
    return dict(requests=len(records), completed=len(done), wall_s=round(wall, 1),
                output_tokens_per_s=sum(r["tokens"] for r in done) / wall,
                median_tpot_ms=statistics.median(tpots) if tpots else None,
                median_ttft_s=statistics.median(r["first"] - r["start"] for r in done)
                if done else None,
                errors=[r.get("error") for r in records if r and not r.get("ok")][:5],
                # per request, for pooling slices (serve_report.py)
                per_request=[dict(prompt_tokens=r.get("prompt_tokens"), ok=bool(r.get("ok")),
                                  tokens=r.get("tokens", 0) if r.get("ok") else 0,
                                  ttft_s=round(r["first"] - r["start"], 4)
                                  if r.get("ok") else None,
                                  tpot_ms=round((r["last"] - r["first"]) / (r["tokens"] - 1)
                                                * 1e3, 4)
                                  if r.get("ok") and r["tokens"] > 1 and r["chunks"] > 1
                                  else None)
                             for r in records])


def host_versions():
    """The GPU and the server's package versions, as far as this host can tell (the client
    runs beside the server)."""
    import importlib.metadata
    import subprocess

    info = {}
    try:
        info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10
                                     ).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    for package in ("vllm", "torch", "triton"):
        try:
            info.setdefault("versions", {})[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    if commit:  # which code the server ran (slices of one pooled row may span commits)
        info["commit"] = commit
    return info


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the first)")
    parser.add_argument("--set", choices=sorted(SETS), default="A")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=0, help="only N prompts (0: all)")
    parser.add_argument("--offset", type=int, default=0, help="from the set's K-th prompt")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help="send no request after this many seconds of the timed run (the "
                             "run then covers the slice's first N prompts; the next slice "
                             "starts at --offset + N)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "serve.json"))
    args = parser.parse_args()
    model = args.model
    if model is None:
        parts = urllib.parse.urlsplit(args.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        connection.request("GET", "/v1/models")
        model = json.loads(connection.getresponse().read())["data"][0]["id"]
    prompts = set_prompts(args.set, args.offset, args.limit)
    # one short untimed request first: whatever the server does at its first request (a
    # kernel built, a pool grown) stays out of the timed run
    stream_completion(args.url, model, prompts[0][:256], 8)
    result = run(args.url, model, prompts, args.concurrency, args.output_tokens, args.deadline)
    result.update(label=args.label, set=args.set, concurrency=args.concurrency, offset=args.offset,
                  output_tokens=args.output_tokens, deadline_s=args.deadline,
                  command="python3 " + " ".join(sys.argv),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), **host_versions())
    # serve_bench.sh starts the server in this environment: its MOIRA_* settings are the arm's
    # (for keys serve_bench.sh's --additional-config does not set: imposed_fraction and
    # stats_interval come from there)
    result["moira_environment"] = {name: value for name, value in sorted(os.environ.items())
                                   if name.startswith("MOIRA_") or name == "SERVE_STATS_INTERVAL"}
    print(json.dumps({k: v for k, v in result.items() if k != "per_request"}, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
