"""Tokens/s of ``dsa generate``, ``dsa demo`` and ``dsa serve`` on CPU under each thread setting,
each command a fresh process (the embedded default model, ``demo-cpu``, random weights).

    python benchmarks/cpu_threads.py --out benchmarks/results/cpu-threads-2cores-2026-12-01.json

Settings (``--settings``, comma-separated): ``omp1`` / ``omp2``: ``OMP_NUM_THREADS=1`` / ``2``, as a
user sets it; ``flag1`` / ``flag2``: ``--cpu-threads 1`` / ``2``; ``default``: neither; ``passive2``:
``OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE`` (OpenMP workers sleep at once instead of spinning).
The runs go round-robin over the settings (``--repeats`` rounds), so a change of the machine's load
hits every setting alike; the 1-minute load average is recorded before each run.

- generate: ``dsa generate --prompt Hello --max-tokens 64 --device cpu``; its summary line's first
  token time and tokens/s after the first;
- demo: ``dsa demo --device cpu --json`` (a 4096-token prompt, 32 new tokens): prefill and decode tokens/s;
- serve: ``dsa serve --device cpu``, then 3 streamed completions in turn (prompt "Hello", 64 tokens,
  greedy, ignore_eos); the median first-chunk time and tokens/s after the first chunk.
"""
import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = {  # name -> (environment, extra arguments)
    "omp1": ({"OMP_NUM_THREADS": "1"}, []),
    "omp2": ({"OMP_NUM_THREADS": "2"}, []),
    "flag1": ({}, ["--cpu-threads", "1"]),
    "flag2": ({}, ["--cpu-threads", "2"]),
    "default": ({}, []),
    "passive2": ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}, []),
}
DSA = [sys.executable, "-m", "dsa"]
SUMMARY = re.compile(r"first token after ([\d.]+) s, ([\d.]+) tokens/s after the first")
THREADS = re.compile(r"(\d+) CPU threads? \(([^)]*)\)")


def environment(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    return {**env, **SETTINGS[setting][0]}


def generate(setting: str) -> dict:
    cmd = DSA + ["generate", "--prompt", "Hello", "--max-tokens", "64", "--device", "cpu", *SETTINGS[setting][1]]
    p = subprocess.run(cmd, env=environment(setting), capture_output=True, text=True, timeout=600, check=True)
    m = SUMMARY.search(p.stderr)
    if m is None:
        raise RuntimeError(f"no summary line in dsa generate's stderr:\n{p.stderr}")
    t = THREADS.search(p.stderr)
    return {"threads": int(t.group(1)), "threads_why": t.group(2), "first_token_s": float(m.group(1)),
            "decode_tokens_per_s": float(m.group(2))}


def demo(setting: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "demo.json")
        cmd = DSA + ["demo", "--device", "cpu", "--json", out, *SETTINGS[setting][1]]
        subprocess.run(cmd, env=environment(setting), capture_output=True, text=True, timeout=600, check=True)
        with open(out) as f:
            r = json.load(f)
    return {"threads": r["cpu_threads"], "prefill_tokens_per_s": r["prefill_tokens_per_s"],
            "decode_tokens_per_s": r["decode_tokens_per_s"]}


def _stream_once(port: int) -> tuple:
    """(seconds to the first chunk, tokens/s after it) of one streamed completion."""
    body = json.dumps({"model": "dsa-default", "prompt": "Hello", "max_tokens": 64, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"dsa serve answered {resp.status}: {resp.read()[:300]!r}")
    times = []
    for line in resp:
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
    conn.close()
    first = times[0] - t0
    return first, (len(times) - 1) / (times[-1] - times[0])


def serve(setting: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = DSA + ["serve", "--device", "cpu", "--port", str(port), *SETTINGS[setting][1]]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=environment(setting), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"dsa serve exited with {proc.returncode}: {log.read()}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.3)
        runs = [_stream_once(port) for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(60)
    log.seek(0)
    t = THREADS.search(log.read())
    return {"threads": int(t.group(1)), "threads_why": t.group(2), "first_token_s": statistics.median(r[0] for r in runs),
            "decode_tokens_per_s": statistics.median(r[1] for r in runs)}


COMMANDS = {"generate": generate, "demo": demo, "serve": serve}


def _rounds(commands: list, settings: list, repeats: int, runs: list) -> None:
    for command in commands:
        for r in range(repeats):
            for setting in settings:
                load = os.getloadavg()[0]
                result = COMMANDS[command](setting)
                runs.append({"command": command, "setting": setting, "round": r, "load_1min_before": load, **result})
                print(json.dumps(runs[-1]), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--settings", default="omp1,omp2,default,flag1,flag2", help="default: %(default)s")
    ap.add_argument("--commands", default="generate,demo,serve", help="default: %(default)s")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the settings (default: %(default)s)")
    ap.add_argument("--note", default="", help="a line on the conditions, kept in the JSON")
    ap.add_argument("--beside-busy", action="store_true", help="run every command beside one busy-looping "
                    "process (another job on the machine)")
    args = ap.parse_args(argv)
    settings, commands = args.settings.split(","), args.commands.split(",")
    for name in settings:
        if name not in SETTINGS:
            raise SystemExit(f"--settings: unknown {name!r}; expected some of {sorted(SETTINGS)}")
    for name in commands:
        if name not in COMMANDS:
            raise SystemExit(f"--commands: unknown {name!r}; expected some of {sorted(COMMANDS)}")
    import torch

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.beside_busy else None
    runs = []
    try:
        _rounds(commands, settings, args.repeats, runs)
    finally:
        if busy is not None:
            busy.kill()
    summary = {}
    for command in commands:
        for setting in settings:
            mine = [x for x in runs if x["command"] == command and x["setting"] == setting]
            keys = [k for k in mine[0] if k.endswith("_s") and k != "load_1min_before"]
            summary.setdefault(command, {})[setting] = {
                "threads": sorted({x["threads"] for x in mine}),
                **{k: round(statistics.median(x[k] for x in mine), 3) for k in keys}}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"command": "python benchmarks/cpu_threads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": commit, "cpus": os.cpu_count(), "torch": torch.__version__,
              "settings": {k: {"env": SETTINGS[k][0], "args": SETTINGS[k][1]} for k in settings},
              "beside_busy": args.beside_busy, "note": args.note, "median": summary, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
