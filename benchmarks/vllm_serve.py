"""Serving throughput: vLLM's OpenAI-compatible server on loopback, closed-loop streaming
clients (paper Figure 5); dense FA3, dense FlashInfer or Moira at the paper's gamma = 0.98
reads (imposed, random weights).

    PYTHONPATH=. python3 benchmarks/vllm_serve.py serve BACKEND [RUN ...] [--kernels ...] \
        [--output-tokens 1024] [--deadline 400]
    python3 benchmarks/vllm_serve.py client --url http://127.0.0.1:8000 --set A \
        --concurrency 16 [--offset K --limit N] [--out $OUT/serve.json]

``serve`` starts one server (``BACKEND``: dense, flashinfer or moira; Llama-3.1-8B geometry,
``max_model_len`` 131072, no prefix caching, 16 sequences), waits for it, runs the clients of
each RUN (``SET:CONCURRENCY``, default ``A:1 A:16 B:1 B:8``; ``SET:C@K`` from prompt K,
``SET:C@K+N`` prompts K..K+N-1) against it, and writes ``$OUT/serve-BACKEND-SET-C.json`` and
the server's log ``$OUT/server-BACKEND.log``. Other plugin settings reach the Moira server
through ``MOIRA_*`` variables (recorded in each result as ``moira_environment``).

``client`` is one such run against a server already up. Prompts are random token ids (the
server runs with ``--skip-tokenizer-init``): set A has 256 prompts of 4k-64k tokens, set B 64
of 64k-126k (lengths uniform in log length, fixed seed). Each of ``--concurrency`` workers
sends one streaming ``/v1/completions`` request at a time (``ignore_eos``, greedy) until the
set is done. Per request: time to first token and TPOT = (last chunk - first chunk) /
(tokens - 1); overall: median TPOT, output tokens per second of wall time, and whether every
request completed with all its tokens. ``--offset K --limit N`` runs prompts K..K+N-1 of the
set (the same prompts as in a whole run): a set too long for one sitting runs in slices, each
against a fresh server, and ``report.py serve`` pools the slices' per-request records.
``--deadline S`` sends no request after S seconds, so a slice sized by time is still written
(give the other arm that slice's ``--limit``: its ``requests``).
"""

import argparse
import http.client
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

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
    tpots = [common.tpot_ms(r["first"], r["last"], r["tokens"]) for r in done
             if r["tokens"] > 1 and r["chunks"] > 1]
    return dict(requests=len(records), completed=len(done), wall_s=round(wall, 1),
                output_tokens_per_s=sum(r["tokens"] for r in done) / wall,
                median_tpot_ms=statistics.median(tpots) if tpots else None,
                median_ttft_s=statistics.median(r["first"] - r["start"] for r in done)
                if done else None,
                errors=[r.get("error") for r in records if r and not r.get("ok")][:5],
                # per request, for pooling slices (report.py serve)
                per_request=[dict(prompt_tokens=r.get("prompt_tokens"), ok=bool(r.get("ok")),
                                  tokens=r.get("tokens", 0) if r.get("ok") else 0,
                                  ttft_s=round(r["first"] - r["start"], 4)
                                  if r.get("ok") else None,
                                  tpot_ms=round((r["last"] - r["first"]) / (r["tokens"] - 1)
                                                * 1e3, 4)
                                  if r.get("ok") and r["tokens"] > 1 and r["chunks"] > 1
                                  else None)
                             for r in records])


def add_client_options(parser):
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=0, help="only N prompts (0: all)")
    parser.add_argument("--offset", type=int, default=0, help="from the set's K-th prompt")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help="send no request after this many seconds of the timed run (the "
                             "run then covers the slice's first N prompts; the next slice "
                             "starts at --offset + N)")


def client(url, model, set_name, concurrency, output_tokens, offset=0, limit=0, deadline=None,
           label="", out=None):
    """One closed-loop run of a set's prompts against the server at ``url``; its result,
    written to ``out``."""
    if model is None:
        parts = urllib.parse.urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        connection.request("GET", "/v1/models")
        model = json.loads(connection.getresponse().read())["data"][0]["id"]
    prompts = set_prompts(set_name, offset, limit)
    # one short untimed request first: whatever the server does at its first request (a
    # kernel built, a pool grown) stays out of the timed run
    stream_completion(url, model, prompts[0][:256], 8)
    result = run(url, model, prompts, concurrency, output_tokens, deadline)
    info = common.run_info("vllm")
    result.update(label=label, set=set_name, concurrency=concurrency, offset=offset,
                  output_tokens=output_tokens, deadline_s=deadline, command=info["command"],
                  date=info["date"], gpu=info["gpu"], versions=info["versions"],
                  commit=info["commit"], dirty=info["dirty"])
    # the server runs in this environment: its MOIRA_* settings are the arm's (for keys the
    # server's --additional-config does not set)
    result["moira_environment"] = {name: value for name, value in sorted(os.environ.items())
                                   if name.startswith("MOIRA_")}
    print(json.dumps({k: v for k, v in result.items() if k != "per_request"}, indent=1))
    if out:
        common.write_json(out, result)
    return result


def parse_run(text):
    """``SET:C[@K[+N]]`` -> (set, concurrency, offset or None, limit or None)."""
    slice_ = None
    if "@" in text:
        text, slice_ = text.split("@", 1)
    set_name, _, concurrency = text.partition(":")
    if set_name not in SETS or not concurrency.isdigit():
        raise argparse.ArgumentTypeError(f"a run is SET:CONCURRENCY[@K[+N]] with SET one of "
                                         f"{sorted(SETS)}, e.g. A:16 or B:1@7+6; got {text!r}")
    offset = limit = None
    if slice_ is not None:
        first, _, count = slice_.partition("+")
        offset, limit = int(first), int(count) if count else None
    return set_name, int(concurrency), offset, limit


def server_command(backend, model, stats_interval=30.0, kernels=None):
    """vLLM's OpenAI server for ``backend`` on 127.0.0.1:8000."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--load-format", "dummy", "--skip-tokenizer-init", "--block-size", "64",
               "--max-model-len", "131072", "--no-enable-prefix-caching", "--max-num-seqs",
               "16", "--gpu-memory-utilization", "0.88", "--host", "127.0.0.1", "--port",
               "8000"]
    if backend == "dense":
        return command + ["--attention-backend", "FLASH_ATTN"]
    if backend == "flashinfer":
        return command + ["--attention-backend", "FLASHINFER"]
    settings = {"imposed_fraction": common.paper_knots("llama-3.1-8b", 0.98),
                "stats_interval": stats_interval}
    if kernels:
        settings["kernels"] = kernels
    return command + ["--attention-backend", "CUSTOM", "--additional-config",
                      json.dumps({"moira": settings})]


def plugin_path():
    """A folder holding a minimal dist-info that declares Moira's ``vllm.general_plugins``
    entry point: the server's engine core is another process, where vLLM registers plugins
    only through entry points, and Moira runs from the source tree."""
    folder = tempfile.mkdtemp(prefix="moira-plugin-")
    info = os.path.join(folder, "moira_vllm_plugin-0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: moira-vllm-plugin\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nmoira = moira.integrations.vllm:register\n")
    return folder


def serve(parser, args):
    options = common.kernel_options(parser, args)
    if args.backend != "moira" and args.kernels:
        parser.error("--kernels are Moira's: the dense servers run FA3 or FlashInfer")
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    plugin = plugin_path()
    environment = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"),
                       VLLM_USE_FLASHINFER_SAMPLER=os.environ.get(
                           "VLLM_USE_FLASHINFER_SAMPLER", "0"),
                       PYTHONPATH=os.pathsep.join(filter(None, [
                           plugin, common.REPO, os.environ.get("PYTHONPATH")])))
    command = server_command(args.backend, common.model_dir("llama-3.1-8b"),
                             args.stats_interval, common.options_mapping(options))
    log_path = os.path.join(out, f"server-{args.backend}.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                  env=environment)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{args.url}/health", timeout=5):
                    break
            except OSError:
                if server.poll() is not None:
                    with open(log_path) as f:
                        print("".join(f.readlines()[-30:]))
                    raise SystemExit(f"the server exited ({server.returncode})")
                time.sleep(1)
        else:
            raise SystemExit("the server did not come up in 600 s")
        for set_name, concurrency, offset, limit in args.runs:
            client(args.url, None, set_name, concurrency, args.output_tokens,
                   args.offset if offset is None else offset,
                   args.limit if limit is None else limit, args.deadline, args.backend,
                   os.path.join(out, f"serve-{args.backend}-{set_name}-{concurrency}.json"))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(plugin, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    routines = parser.add_subparsers(dest="routine", required=True)
    one = routines.add_parser("serve", help="a server and the clients of each run")
    one.add_argument("backend", choices=["dense", "flashinfer", "moira"])
    one.add_argument("runs", nargs="*", type=parse_run,
                     default=[parse_run(run) for run in ("A:1", "A:16", "B:1", "B:8")],
                     help="SET:CONCURRENCY[@K[+N]] (default: A:1 A:16 B:1 B:8)")
    one.add_argument("--url", default="http://127.0.0.1:8000")
    one.add_argument("--stats-interval", type=float, default=30.0,
                     help="moira: the plugin's stats_interval (the page-read log line; 0 "
                          "turns Merge's counters off, as in the TPOT and profile engines)")
    add_client_options(one)
    common.add_kernel_options(one)
    one = routines.add_parser("client", help="one closed-loop run against a server")
    one.add_argument("--url", default="http://127.0.0.1:8000")
    one.add_argument("--model", default=None, help="served model name (default: the first)")
    one.add_argument("--set", choices=sorted(SETS), default="A")
    one.add_argument("--concurrency", type=int, default=16)
    one.add_argument("--label", default="")
    one.add_argument("--out", default=common.out_path("serve.json"))
    add_client_options(one)
    args = parser.parse_args(argv)
    if args.routine == "serve":
        return serve(routines.choices["serve"], args)
    client(args.url, args.model, args.set, args.concurrency, args.output_tokens, args.offset,
           args.limit, args.deadline, args.label, args.out)


if __name__ == "__main__":
    main()
